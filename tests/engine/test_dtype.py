"""``--dtype auto``: which precision the engine loads, from the device, the CPU's flags
and, on a CPU with bf16 arithmetic, the model's GEMMs timed in both."""

from __future__ import annotations

import math

import pytest
from transformers import LlamaConfig, PretrainedConfig

from sluice.engine.loader import (
    BF16_MARGIN,
    cpu_has_native_bf16,
    decoder_linear_shapes,
    measured_bf16_speedup,
    resolve_dtype,
)

XEON_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni amx_tile\n"
XEON_AMX_ONLY = "flags\t\t: fpu avx512f amx_bf16 amx_tile\n"
AVX512_NO_BF16 = "flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512vl avx512dq\n"  # emulation only
NO_FLAGS = "processor\t: 0\nmodel name\t: ARM\n"


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [(XEON_BF16, True), (XEON_AMX_ONLY, True), (AVX512_NO_BF16, False), (NO_FLAGS, False)],
)
def test_native_bf16_is_read_from_the_flags(cpuinfo: str, native: bool) -> None:
    assert cpu_has_native_bf16(cpuinfo) is native


def never_measured() -> float:
    raise AssertionError("nothing to measure for this device or CPU")


def test_auto_resolves_by_device_and_cpu() -> None:
    assert resolve_dtype("auto", "cuda", NO_FLAGS, never_measured) == "bfloat16"
    assert resolve_dtype("auto", "cpu", AVX512_NO_BF16, never_measured) == "float32"
    assert resolve_dtype("float32", "cpu", XEON_BF16, never_measured) == "float32"
    assert resolve_dtype("float16", "cuda", NO_FLAGS, never_measured) == "float16"


@pytest.mark.parametrize(
    ("speedup", "dtype"),
    [(1.6, "bfloat16"), (BF16_MARGIN, "bfloat16"), (1.05, "float32"), (0.8, "float32")],
)
def test_a_bf16_cpu_takes_bf16_only_where_it_measures_faster(speedup: float, dtype: str) -> None:
    """Near a tie fp32 wins: its tokens hold in a busy batch, its logprobs are exact."""
    assert resolve_dtype("auto", "cpu", XEON_BF16, lambda: speedup) == dtype


def test_the_measured_shapes_are_the_models_own() -> None:
    config = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        num_hidden_layers=30,
        vocab_size=49152,
    )
    assert decoder_linear_shapes(config) == (
        (576, 576, 60),
        (192, 576, 60),
        (1536, 576, 90),
        (49152, 576, 1),
    )
    assert decoder_linear_shapes(PretrainedConfig()) is None


def test_the_measurement_is_a_ratio_of_real_timings() -> None:
    speedup = measured_bf16_speedup(((64, 32, 2), (128, 32, 1)))
    assert 0 < speedup < math.inf  # tiny shapes: bf16's per-call floor can make it ≪ 1

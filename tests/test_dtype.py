"""``--dtype auto``: which precision the engine loads, from the device and the CPU's flags."""

from __future__ import annotations

import pytest

from sluice.engine.loader import cpu_has_native_bf16, resolve_dtype

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


def test_auto_resolves_by_device_and_cpu() -> None:
    assert resolve_dtype("auto", "cuda", NO_FLAGS) == "bfloat16"
    assert resolve_dtype("auto", "cpu", XEON_BF16) == "bfloat16"
    assert resolve_dtype("auto", "cpu", AVX512_NO_BF16) == "float32"
    assert resolve_dtype("float32", "cpu", XEON_BF16) == "float32"
    assert resolve_dtype("float16", "cuda", NO_FLAGS) == "float16"

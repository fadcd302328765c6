"""``--dtype auto`` (``engine/precision.py``): which precision the engine serves in,
from the device, the CPU's flags and, on a CPU with bf16 arithmetic, the model's GEMMs
timed in both, repeated, kept per machine, and the same for servers that start together."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig, PretrainedConfig

from sluice.engine.cpu import CpuInfo, parse_cpuinfo
from sluice.engine.loader import decoder_linear_shapes, measured_bf16_speedup
from sluice.engine.precision import BF16_MARGIN, MEASUREMENTS, choose_precision

XEON_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni amx_tile\n"
XEON_AMX_ONLY = "flags\t\t: fpu avx512f amx_bf16 amx_tile\n"
AVX512_NO_BF16 = "flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512vl avx512dq\n"  # emulation only
NO_FLAGS = "processor\t: 0\nmodel name\t: ARM\n"
ZEN5 = (
    "vendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9B45\nflags\t\t: avx2 avx512f avx512_bf16\n"
)
SHAPES = ((64, 32, 2), (128, 32, 1))


def shapes() -> tuple[tuple[int, int, int], ...]:
    return SHAPES


def cpu(text: str) -> CpuInfo:
    return parse_cpuinfo(text, 2)


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [(XEON_BF16, True), (XEON_AMX_ONLY, True), (AVX512_NO_BF16, False), (NO_FLAGS, False)],
)
def test_native_bf16_is_read_from_the_flags(cpuinfo: str, native: bool) -> None:
    assert cpu(cpuinfo).native_bf16 is native


def never_measured(shapes: object) -> float:
    raise AssertionError("nothing to measure for this device or CPU")


def test_auto_resolves_by_device_and_cpu() -> None:
    def choose(requested: str, device: str, text: str) -> tuple[str, str]:
        got = choose_precision(requested, device, shapes, cpu=cpu(text), measure=never_measured)
        return got.dtype, got.reason

    assert choose("auto", "cuda", NO_FLAGS) == ("bfloat16", "cuda")
    assert choose("auto", "cpu", AVX512_NO_BF16) == ("float32", "no bf16 arithmetic")
    assert choose("float32", "cpu", XEON_BF16) == ("float32", "--dtype")
    assert choose("float16", "cuda", NO_FLAGS) == ("float16", "--dtype")


@pytest.mark.parametrize(
    ("speedups", "dtype"),
    [
        ((1.6, 1.7, 1.5), "bfloat16"),
        ((BF16_MARGIN,) * 3, "bfloat16"),
        ((1.05, 1.0, 1.08), "float32"),
        ((0.8, 0.9, 0.7), "float32"),
        ((2.0, 1.02, 1.03), "float32"),  # one fast reading does not decide: the median does
        ((1.02, 2.3, 1.9), "bfloat16"),  # nor one slow one (another process was timing too)
    ],
)
def test_a_bf16_cpu_takes_bf16_where_the_median_measures_faster(
    speedups: tuple[float, ...], dtype: str
) -> None:
    readings = iter(speedups)
    got = choose_precision(
        "auto", "cpu", shapes, cpu=cpu(XEON_BF16),
        measure=lambda _: next(readings),
    )  # fmt: skip
    assert (got.dtype, got.reason, got.measurements) == (dtype, "measured", speedups)
    assert len(speedups) == MEASUREMENTS
    assert got.to_dict()["margin"] == BF16_MARGIN and dtype in got.line()


def test_the_decision_is_kept_per_cpu_and_read_back(tmp_path: Path) -> None:
    calls: list[int] = []

    def measure(_: object) -> float:
        calls.append(1)
        return 1.5

    xeon, zen = cpu(XEON_BF16), cpu(ZEN5)
    first = choose_precision("auto", "cpu", shapes, cpu=xeon, cache_dir=tmp_path, measure=measure)
    again = choose_precision("auto", "cpu", shapes, cpu=xeon, cache_dir=tmp_path,
                             measure=never_measured)  # fmt: skip
    assert (first.reason, again.reason) == ("measured", "measured earlier")
    assert (again.dtype, again.speedup) == (first.dtype, first.speedup) == ("bfloat16", 1.5)
    assert len(calls) == MEASUREMENTS
    other = choose_precision("auto", "cpu", shapes, cpu=zen, cache_dir=tmp_path, measure=measure)
    assert other.reason == "measured" and len(calls) == 2 * MEASUREMENTS  # another CPU
    assert len(list(tmp_path.glob("*.json"))) == 2
    for kept in tmp_path.glob("*.json"):
        kept.write_text("{not json")  # a damaged file is measured again
    assert choose_precision("auto", "cpu", shapes, cpu=xeon, cache_dir=tmp_path,
                            measure=measure).reason == "measured"  # fmt: skip


CONCURRENT = """
import sys, time
from pathlib import Path
from sluice.engine.cpu import CpuInfo, parse_cpuinfo
from sluice.engine.precision import choose_precision

def measure(_):
    time.sleep(0.3)  # long enough for the other process to arrive meanwhile
    return float(sys.argv[2])

cpu = parse_cpuinfo({cpuinfo!r}, 2)
got = choose_precision("auto", "cpu", lambda: ((8, 8, 1),), cpu=cpu,
                       cache_dir=Path(sys.argv[1]), measure=measure)
print("RESULT", got.dtype, "|", got.reason)
"""


def test_processes_starting_together_choose_alike(tmp_path: Path) -> None:
    """Each would measure differently (one ×2.0, one ×1.0); the second waits for the
    first's decision and reads it, whichever comes first."""
    script = CONCURRENT.format(cpuinfo=XEON_BF16)
    procs = [
        subprocess.Popen([sys.executable, "-P", "-c", script, str(tmp_path), speedup],
                         stdout=subprocess.PIPE, text=True)
        for speedup in ("2.0", "1.0")
    ]  # fmt: skip
    printed = [proc.communicate(timeout=120)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    results = [
        line.removeprefix("RESULT ").split(" | ")
        for out in printed
        for line in out.splitlines()
        if line.startswith("RESULT ")
    ]
    assert len(results) == 2 and results[0][0] == results[1][0], printed
    assert sorted(reason for _, reason in results) == ["measured", "measured earlier"]


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
    speedup = measured_bf16_speedup(SHAPES)
    assert 0 < speedup < math.inf  # tiny shapes: bf16's per-call floor can make it ≪ 1


def test_a_folder_it_cannot_write_decides_for_this_start_only(tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder would be")
    got = choose_precision("auto", "cpu", shapes, cpu=cpu(XEON_BF16), cache_dir=blocked,
                           measure=lambda _: 1.4)  # fmt: skip
    assert (got.dtype, got.reason) == ("bfloat16", "measured")

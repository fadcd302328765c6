"""Sluice's kernels built as for a CPU with AVX2 alone (an AMD Zen 2 or Zen 3: no
AVX-512, no AVX-VNNI, the build ``--isa avx2`` benchmarks) pass the same kernel tests as
this CPU's own build: their narrow paths (8-bit codes as signed bytes, eight lanes a
group) are otherwise never run on a machine whose CPU has more."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sluice.bench.emulated_isa import ISAS
from sluice.engine.native_kernels import BUILD_ERRORS, build
from tests.conftest import missing

ROOT = Path(__file__).resolve().parents[2]
# The test files that multiply with Sluice's kernels.
KERNEL_TESTS = [
    "tests/unit/test_gguf_blocks.py",
    "tests/unit/test_decode_attention.py",
    "tests/unit/test_decode_row_ops.py",
    "tests/unit/test_decode_stack_gemm.py",
    "tests/unit/test_kernel_choice.py",
    "tests/unit/test_prepacked_dense.py",
    "tests/unit/test_sampling_ops.py",
]
# The library loaded before the tests start, so that they find its ops already there
# (``planes_kernel`` then loads nothing of its own).
RUN = """
import sys, pytest, torch
torch.ops.load_library(sys.argv[1])
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[2:]]))
"""


def test_the_avx2_build_passes_the_kernel_tests() -> None:
    _, flags = ISAS["avx2"]
    try:
        library = build(compiler_flags=flags)
    except BUILD_ERRORS as error:
        missing(f"the kernels do not build for AVX2 here: {error}", "builds them")
    done = subprocess.run(
        [sys.executable, "-P", "-c", RUN, str(library), *KERNEL_TESTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary, summary

"""Sluice's kernels built as for a CPU with AVX2 alone (an AMD Zen 2 or Zen 3: no
AVX-512, no AVX-VNNI, the build ``--isa avx2`` benchmarks) pass the same kernel tests as
this CPU's own build: their narrow paths (8-bit codes as signed bytes, eight lanes a
group) are otherwise never run on a machine whose CPU has more."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import missing

ROOT = Path(__file__).resolve().parents[2]
CANNOT_BUILD = 3  # the exit status of a child that could not build the kernels
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
# Built and loaded in a process of its own before the tests start, so that they find its
# ops already there (``planes_kernel`` then loads nothing of its own). Not in pytest's
# process: a build loads its library, and a second library registering the native
# build's ops there aborts the process (seen in CI).
RUN = """
import sys, pytest, torch
from sluice.bench.emulated_isa import ISAS
from sluice.engine.native_kernels import BUILD_ERRORS, build
try:
    library = build(compiler_flags=ISAS["avx2"][1])
except BUILD_ERRORS as error:
    print(f"cannot build: {error}")
    sys.exit(int(sys.argv[1]))
torch.ops.load_library(library)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[2:]]))
"""


def test_the_avx2_build_passes_the_kernel_tests() -> None:
    done = subprocess.run(
        [sys.executable, "-P", "-c", RUN, str(CANNOT_BUILD), *KERNEL_TESTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode == CANNOT_BUILD:
        missing(f"the kernels do not build for AVX2 here: {done.stdout.strip()}", "builds them")
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary, summary

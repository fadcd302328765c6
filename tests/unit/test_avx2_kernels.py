"""Sluice's kernels built as for a CPU with AVX2 alone (an AMD Zen 2 or Zen 3: no
AVX-512, no AVX-VNNI, the build ``--isa avx2`` benchmarks), and as for one with AVX-VNNI
but no AVX-512 (an Intel Alder Lake), pass the same kernel tests as this CPU's own
build: their narrow paths (8-bit codes as signed bytes, eight-row blocks, AVX-VNNI's
256-bit dot product) are otherwise never run on a machine whose CPU has more."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sluice.bench.emulated_isa import ISAS
from sluice.engine.cpu import host_cpu
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
from sluice.engine.native_kernels import BUILD_ERRORS, build
try:
    library = build(compiler_flags=tuple(sys.argv[2].split()))
except BUILD_ERRORS as error:
    print(f"cannot build: {error}")
    sys.exit(int(sys.argv[1]))
torch.ops.load_library(library)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[3:]]))
"""
# Each narrow build's compiler flags after ``-march=native``, and the CPU flag it needs.
BUILDS = {
    "avx2": (ISAS["avx2"][1], "avx2"),
    "avx-vnni": (("-mno-avx512f",), "avx_vnni"),
}


@pytest.mark.parametrize("build", BUILDS)
def test_a_narrow_build_passes_the_kernel_tests(build: str) -> None:
    flags, needed = BUILDS[build]
    if needed not in host_cpu().flags:
        # Not a missing tool: this CPU cannot run that build's instructions.
        pytest.skip(f"this CPU has no {needed}")
    done = subprocess.run(
        [sys.executable, "-P", "-c", RUN, str(CANNOT_BUILD), " ".join(flags), *KERNEL_TESTS],
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

"""Running a bench as on a CPU with less than this one has: torch's and oneDNN's kernels
told to use less, Sluice's own kernels built without the extensions (in a build folder
of their own), and the decisions measured meanwhile kept apart from the real ones.

- ``avx2``: AVX2 alone, no AVX-512 and no bf16 arithmetic (``ATEN_CPU_CAPABILITY=avx2``;
  ``-mno-avx512f``).
- ``avx512``: AVX-512 with VNNI and BF16 but no AMX, as on an AMD Zen 4, from an Intel
  Xeon that has AMX (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``; ``-mno-amx-tile
  -mno-amx-int8 -mno-amx-bf16``).

Cache sizes, memory bandwidth and the cores' ports stay this machine's: an emulated
figure says what the kernels' choice changes here, not what the other CPU would run.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from sluice.engine.native_kernels import build
from sluice.engine.precision import default_cache_dir

ISAS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, ("-mno-avx512f",)),
    "avx512": (
        {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
        ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"),
    ),
}
CHOICES = ("native", *ISAS)
DECISIONS = "SLUICE_PRECISION_CACHE"


def add_isa_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--isa", choices=CHOICES, default="native", help="as on a CPU with less")


def emulate(isa: str, module: str) -> None:
    """As on a CPU with ``isa`` alone (``native``: nothing). torch and oneDNN read their
    variables once, at start, so the first call starts this process again (``python -P
    -m module`` with the same arguments) with them set; then Sluice's kernels are loaded
    from a build of their own, and a line says what is emulated."""
    if isa == "native":
        return
    env, flags = ISAS[isa]
    if any(os.environ.get(name) != value for name, value in env.items()):
        # Precision, kernel and packed-row decisions measured as another CPU would go to
        # a folder of their own: a later server here must not read them.
        kept = {DECISIONS: str(default_cache_dir() / f"emulated-{isa}")}
        command = [sys.executable, "-P", "-m", module, *sys.argv[1:]]
        os.execve(sys.executable, command, {**os.environ, **env, **kept})
    torch.ops.load_library(str(build(compiler_flags=flags)))
    said = " ".join(f"{name}={value}" for name, value in env.items())
    print(f"as {isa}: {said}, Sluice's kernels built with {' '.join(flags)}")

"""Running a bench as on a CPU with less than this one has: torch's and oneDNN's kernels
told to use less, Sluice's own kernels built without the extensions (in a build folder
of their own), and the decisions measured meanwhile kept apart from the real ones.

- ``avx2``: AVX2 alone, no AVX-512, AVX-VNNI or bf16 arithmetic, as on an AMD Zen 2 or
  Zen 3 (``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``,
  ``MKL_ENABLE_INSTRUCTIONS=AVX2``; ``-mno-avx512f -mno-avxvnni``). Its peer is
  llama-server built the same way (``LLAMA_ISA=avx2 bench/build_llama_server.sh``).
- ``avx512``: AVX-512 with VNNI and BF16 but no AMX, as on an AMD Zen 4, from an Intel
  Xeon that has AMX (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``; ``-mno-amx-tile
  -mno-amx-int8 -mno-amx-bf16``).

Cache sizes, memory bandwidth and the cores' ports stay this machine's: an emulated
figure says what the kernels' choice changes here, not what the other CPU would run.

``python -P -m sluice.bench.emulated_isa --isa avx512 [sluice flags]`` serves as the
``sluice`` command does, emulated (the suite's ``--isa`` starts Sluice so). Every bench
machine line run under emulation says so (``emulated()``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from sluice.engine.native_kernels import build
from sluice.engine.precision import default_cache_dir

ISAS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "avx2": (
        {
            "ATEN_CPU_CAPABILITY": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        },
        ("-mno-avx512f", "-mno-avxvnni"),
    ),
    "avx512": (
        {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
        ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"),
    ),
}
CHOICES = ("native", *ISAS)
DECISIONS = "SLUICE_PRECISION_CACHE"
# Set in an emulated process's environment, so its children (a server, a load generator)
# know it too.
EMULATED = "SLUICE_EMULATED_ISA"


def emulated() -> str | None:
    """The ISA this process runs as (``avx512``), or None where it runs natively."""
    isa = os.environ.get(EMULATED)
    return isa if isa in ISAS else None


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
    # Started again unless the environment already names the emulation itself, so that
    # every process run as ``isa`` says so in its machine line (``emulated``).
    if any(os.environ.get(name) != value for name, value in {**env, EMULATED: isa}.items()):
        # Precision, kernel and packed-row decisions measured as another CPU would go to
        # a folder of their own: a later server here must not read them.
        kept = {DECISIONS: str(default_cache_dir() / f"emulated-{isa}"), EMULATED: isa}
        command = [sys.executable, "-P", "-m", module, *sys.argv[1:]]
        os.execve(sys.executable, command, {**os.environ, **env, **kept})
    torch.ops.load_library(str(build(compiler_flags=flags)))
    said = " ".join(f"{name}={value}" for name, value in env.items())
    print(f"as {isa}: {said}, Sluice's kernels built with {' '.join(flags)}")


def serve(argv: list[str] | None = None) -> int:
    """Sluice's server as on a CPU with less: ``--isa``, then the ``sluice`` command's flags."""
    p = argparse.ArgumentParser(
        prog="python -P -m sluice.bench.emulated_isa", add_help=False, allow_abbrev=False
    )
    add_isa_argument(p)
    args, rest = p.parse_known_args(argv)
    emulate(args.isa, "sluice.bench.emulated_isa")
    from sluice.cli import main

    return main(rest)


if __name__ == "__main__":
    sys.exit(serve())

"""Sluice's own CPU kernels (``engine/kernels/*.cpp``), compiled for this machine.

``planes_mm`` multiplies a GGUF linear's 4-bit planes by activations quantised to int8
per group of 32, with integer dot products (AVX-512 VNNI, AVX-VNNI or AVX2), as
llama.cpp multiplies its blocks; ``blocks_mm.cpp`` does the same for one plane (8-bit
or 4-bit codes) laid out sixteen rows side by side (AVX-512 VNNI, and AMX's tiles
from sixteen activation rows where the CPU grants them);
``decode_ops.cpp`` holds the small steps of a decoder layer at decode time, and
``decode_stack.cpp`` strings them and the GEMMs together over every layer for
``engine/direct_decode.py``; ``sampling_ops.cpp`` takes each row's argmax of a step's
logits for ``engine/sampler.py``. They are
compiled with ``-march=native``, so a build runs only on the CPU it was built for: each
build lives in a folder named by the CPU (vendor, model, every flag), the torch build
and the sources, beside the converted models (``models/cache/kernels``). ``make``
builds them; a server that finds none builds them at start (about twenty seconds;
servers starting together wait for the first). Where they cannot be built (no
compiler, no AVX2) the packed GEMM is torch's own and decode steps run through
transformers' layers, and the start-up log and ``/server_info`` say why.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import orjson
import structlog
import torch

from .cpu import host_cpu
from .precision import file_lock

log = structlog.get_logger(__name__)

KERNELS_DIR = Path(__file__).parent / "kernels"
SOURCES = tuple(
    KERNELS_DIR / name
    for name in (
        "planes_mm.cpp",
        "blocks_mm.cpp",
        "decode_ops.cpp",
        "decode_stack.cpp",
        "sampling_ops.cpp",
    )
)
HEADERS = (KERNELS_DIR / "kernels.h",)
LIBRARY = "sluice_kernels"
# What the kernel needs of the CPU: AVX2 with FMA and F16C (fp16 scales).
REQUIRED_FLAGS = frozenset({"avx2", "fma", "f16c"})
# What a build that cannot be done raises: the compiler missing or failing, torch's
# build helpers missing, the CPU lacking a flag.
BUILD_ERRORS = (RuntimeError, OSError, subprocess.SubprocessError, ImportError)


def build_key(compiler_flags: tuple[str, ...] = ()) -> str:
    """The build's folder name: the CPU, the torch build, the source and any compiler
    flags beyond the defaults."""
    cpu = host_cpu()
    what = {
        "vendor": cpu.vendor,
        "model": cpu.model,
        "flags": sorted(cpu.flags),
        "torch": torch.__version__,
        "source": hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS)).hexdigest(),
        "compiler_flags": list(compiler_flags),
    }
    return hashlib.sha256(orjson.dumps(what)).hexdigest()[:16]


def default_build_root() -> Path:
    from sluice.engine.loader import default_models_dir

    return default_models_dir() / "cache" / "kernels"


def _library_file(folder: Path) -> Path | None:
    found = sorted(folder.glob(f"{LIBRARY}*.so"))
    return found[0] if found else None


def build(root: Path | None = None, compiler_flags: tuple[str, ...] = ()) -> Path:
    """Compile the kernels for this machine (unless built already); their library file.
    ``compiler_flags`` (the bench's ``-mno-avx512f``) go after the defaults."""
    from torch.utils import cpp_extension

    missing = REQUIRED_FLAGS - host_cpu().flags
    if missing:
        raise RuntimeError(f"the CPU lacks {', '.join(sorted(missing))}")
    folder = (root or default_build_root()) / build_key(compiler_flags)
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder / ".lock"):
        built = _library_file(folder)
        if built is not None:
            return built
        staging = folder / "staging"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        with _tools_on_path():
            cpp_extension.load(
                name=LIBRARY,
                sources=[str(source) for source in SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp", *compiler_flags],
                extra_ldflags=["-fopenmp"],
                build_directory=str(staging),
                is_python_module=False,
                verbose=False,
            )
        made = _library_file(staging)
        if made is None:
            raise RuntimeError(f"the build left no {LIBRARY}*.so in {staging}")
        # Renamed into place only when whole: a build cut short is never loaded.
        final = folder / made.name
        made.replace(final)
        shutil.rmtree(staging, ignore_errors=True)
        return final


@contextlib.contextmanager
def _tools_on_path() -> Iterator[None]:
    """The virtualenv's ``bin`` on ``PATH`` while building: torch runs ``ninja`` by name,
    and the ``ninja`` package installs it there, where a server started as
    ``.venv/bin/sluice`` without activating the environment would not look."""
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), before])
    try:
        yield
    finally:
        os.environ["PATH"] = before


@cache
def planes_kernel() -> str | None:
    """Load ``planes_mm`` (building it first where needed); None where it is available,
    else why not (the packed GEMM is then torch's)."""
    if hasattr(torch.ops, LIBRARY) and hasattr(getattr(torch.ops, LIBRARY), "planes_mm"):
        return None
    try:
        library = build()
        # ``load`` above registered the ops already when this process built them.
        if not hasattr(getattr(torch.ops, LIBRARY), "planes_mm"):
            torch.ops.load_library(str(library))
    except BUILD_ERRORS as error:
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        log.warning("own packed kernel unavailable, torch's serves", reason=reason)
        return reason
    _register_fake()
    return None


def loaded_op(name: str) -> Any | None:
    """``torch.ops.sluice_kernels.<name>`` where this process has loaded the library
    (``planes_kernel`` loads it with the model), else None; never builds it."""
    namespace = getattr(torch.ops, LIBRARY)
    return getattr(namespace, name) if hasattr(namespace, name) else None


def _planes_mm_shape(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offset: torch.Tensor | None
) -> torch.Tensor:
    # [P, N, K or K/2], or one plane in blocks [N/16, K/4 or K/8, 16, 4]
    out = codes.shape[0] * codes.shape[2] if codes.dim() == 4 else codes.shape[1]
    return x.new_empty((x.shape[0], out), dtype=torch.float32)


def _register_fake() -> None:
    """Shapes for tracing (``--enable-torch-compile``): inductor keeps the op opaque."""
    torch.library.register_fake(f"{LIBRARY}::planes_mm", _planes_mm_shape)


def main() -> int:
    """``python -P -m sluice.engine.native_kernels``: build for this machine (``make``)."""
    try:
        print(build())
    except BUILD_ERRORS as error:
        print(f"own kernels not built ({error}); torch's packed GEMM will serve", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

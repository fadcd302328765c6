"""Which precision ``--dtype auto`` serves in: decided once per machine, and said.

bf16 on CUDA. On a CPU it depends on the CPU: without bf16 arithmetic (AVX512-BF16 or
AMX-BF16) fp32; with it, bf16 only where the model's own GEMMs time at least
``BF16_MARGIN`` faster in it, measured here. One quick timing was a coin toss: two
servers started together on an AMD EPYC measured ×1.02 and took fp32, the same build
alone measured ×1.9–2.4 and took bf16. So the measurement is repeated (the median of
``MEASUREMENTS``, each of interleaved repeats), and its outcome is kept in a file keyed
by the CPU (vendor, model, kernel flags), the torch build, the threads and the shapes,
and reused by every later start; concurrent starts wait for the first one's
measurement under a file lock instead of measuring against each other. ``--dtype``
overrides it; deleting the file measures again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import statistics
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import orjson
import structlog

from sluice.engine.cpu import CpuInfo, host_cpu
from sluice.engine.platform import platform

log = structlog.get_logger(__name__)

BF16_MARGIN = 1.1
MEASUREMENTS = 3
Shapes = tuple[tuple[int, int, int], ...]  # (out, in, how many a step runs)
T = TypeVar("T")


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision served and why: ``reason`` is ``--dtype``, ``cuda``, ``no bf16
    arithmetic``, ``measured`` or ``measured earlier`` (read from the cache file)."""

    dtype: str
    reason: str
    speedup: float | None = None  # fp32 ÷ bf16 time of the model's GEMMs (median)
    measurements: tuple[float, ...] = ()
    cpu: str = ""

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "measurements": list(self.measurements), "margin": BF16_MARGIN}

    def line(self) -> str:
        figures = f", bf16 ×{self.speedup:.2f} faster" if self.speedup is not None else ""
        return f"{self.dtype} ({self.reason}{figures}; needs ×{BF16_MARGIN})"


def default_cache_dir() -> Path:
    """Where decisions are kept: ``SLUICE_PRECISION_CACHE``, else beside the converted
    models."""
    from sluice.engine.loader import default_models_dir

    configured = os.environ.get("SLUICE_PRECISION_CACHE")
    return Path(configured) if configured else default_models_dir() / "cache" / "precision"


def choose_precision(
    requested: str,
    device: str,
    shapes: Callable[[], Shapes],
    *,
    cpu: CpuInfo | None = None,
    cache_dir: Path | None = None,
    measure: Callable[[Shapes], float] | None = None,
) -> PrecisionChoice:
    """``requested`` unless it is ``auto``; else as the module says. ``shapes`` are read
    only when a measurement is needed; ``cache_dir`` None measures without keeping it."""
    if requested != "auto":
        return PrecisionChoice(requested, "--dtype")
    fixed = platform(device).auto_dtype
    if fixed is not None:
        return PrecisionChoice(fixed, device)
    cpu = cpu or host_cpu()
    if not cpu.native_bf16:
        return PrecisionChoice("float32", "no bf16 arithmetic", cpu=cpu.line())
    if measure is None:
        from sluice.engine.loader import measured_bf16_speedup

        measure = measured_bf16_speedup
    measured = shapes()
    if cache_dir is None:
        return _measure(measure, measured, cpu)
    path = cache_dir / f"{cpu_key(cpu, shapes=measured)}.json"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with file_lock(path.with_suffix(".lock")):
            kept = _read(path, cpu)
            if kept is not None:
                return kept
            choice = _measure(measure, measured, cpu)
            partial = path.with_suffix(".partial")
            partial.write_bytes(orjson.dumps(choice.to_dict()))
            partial.replace(path)
            return choice
    except OSError as exc:  # a read-only models folder: decide for this start only
        log.warning("precision not kept", path=str(path), error=str(exc))
        return _measure(measure, measured, cpu)


def _read(path: Path, cpu: CpuInfo) -> PrecisionChoice | None:
    """The decision kept in ``path``; None where none is, or it cannot be read."""
    try:
        kept = orjson.loads(path.read_bytes())
        return PrecisionChoice(
            kept["dtype"], "measured earlier", kept["speedup"],
            tuple(kept["measurements"]), cpu.line(),
        )  # fmt: skip
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError):
        return None


def _measure(measure: Callable[[Shapes], float], shapes: Shapes, cpu: CpuInfo) -> PrecisionChoice:
    figures = tuple(round(measure(shapes), 3) for _ in range(MEASUREMENTS))
    speedup = statistics.median(figures)
    dtype = "bfloat16" if speedup >= BF16_MARGIN else "float32"
    log.info("precision measured", dtype=dtype, bf16_speedups=figures, margin=BF16_MARGIN)
    return PrecisionChoice(dtype, "measured", speedup, figures, cpu.line())


def cpu_key(cpu: CpuInfo, **what: object) -> str:
    """A file name for a decision kept per CPU (vendor, model, kernel flags), torch
    build and thread count, and whatever else ``what`` says it depends on."""
    import torch

    key = {"vendor": cpu.vendor, "model": cpu.model, "flags": cpu.kernel_flags,
           "torch": torch.__version__, "threads": torch.get_num_threads(), **what}  # fmt: skip
    return hashlib.sha256(orjson.dumps(key)).hexdigest()[:16]


def kept_decision(
    path: Path,
    read: Callable[[bytes], T],
    measure: Callable[[], T],
    encode: Callable[[T], bytes],
    what: str,
) -> tuple[T, bool]:
    """The decision kept at ``path`` (``read`` raises for one missing or unreadable),
    else ``measure``'s, kept there; and whether it was kept earlier. Processes starting
    together wait on the lock for the first one's; a folder that cannot be written
    decides for this start only."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(path.with_suffix(".lock")):
            try:
                return read(path.read_bytes()), True
            except (OSError, ValueError, KeyError, TypeError):
                pass
            decided = measure()
            partial = path.with_suffix(".partial")
            partial.write_bytes(encode(decided))
            partial.replace(path)
            return decided, False
    except OSError as exc:  # a read-only models folder
        log.warning(f"{what} not kept", path=str(path), error=str(exc))
        return measure(), False


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock held on ``path`` (created): processes starting together wait for
    the first one's measurement instead of measuring against each other."""
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)

"""Which precision ``--dtype auto`` serves in: decided once per machine, and said.

bf16 on CUDA. On a CPU it depends on the CPU: without bf16 arithmetic (AVX512-BF16 or
AMX-BF16) fp32; with it, bf16 only where the model's own GEMMs time at least
``BF16_MARGIN`` faster in it, measured here. One quick timing was a coin toss: two
servers started together on an AMD EPYC measured ×1.02 and took fp32, the same build
alone measured ×1.9–2.4 and took bf16. So the measurement is repeated (the median of
``MEASUREMENTS``, each of interleaved repeats), and its outcome is kept in a file keyed
by the CPU (vendor, model, kernel flags), the torch build, the threads and the shapes,
and reused by every later start; concurrent starts wait for the first one's
measurement under a file lock instead of measuring against each other. One taken
while other processes kept the CPUs busy (``machine_load``) serves only the starts
that raced it: a later start measures again. ``--dtype`` overrides it; deleting the
file measures again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import orjson
import structlog

from sluice.engine.cpu import CpuInfo, host_cpu
from sluice.engine.machine_load import BUSY_SHARE, others_share
from sluice.engine.platform import platform

log = structlog.get_logger(__name__)

BF16_MARGIN = 1.1
# How long a decision measured on a busy machine serves the starts that raced it.
BUSY_KEPT_S = 600
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
    timing, measured = measure, shapes()  # ``timing``: for the closure below, not None
    if cache_dir is None:
        return _measure(timing, measured, cpu)
    path = cache_dir / f"{cpu_key(cpu, shapes=measured)}.json"

    def read(kept: bytes) -> PrecisionChoice:
        fields = orjson.loads(kept)
        return PrecisionChoice(
            fields["dtype"], "measured earlier", fields["speedup"],
            tuple(fields["measurements"]), cpu.line(),
        )  # fmt: skip

    choice, _ = kept_decision(
        path,
        read,
        lambda: _measure(timing, measured, cpu),
        lambda choice: orjson.dumps(choice.to_dict()),
        "precision",
    )
    return choice


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
    watch: Callable[[Callable[[], T]], tuple[T, float | None]] = others_share,
) -> tuple[T, bool]:
    """The decision kept at ``path`` (``read`` raises for one missing or unreadable),
    else ``measure``'s, kept there; and whether it was kept earlier. Processes starting
    together wait on the lock for the first one's; a folder that cannot be written
    decides for this start only.

    One measured while other processes took more than ``BUSY_SHARE`` of the CPUs
    (``watch``; ``machine_load``) is marked so: the starts racing it read it (servers
    starting together still choose alike), and the first start ``BUSY_KEPT_S`` later
    measures again."""
    busy = path.with_suffix(".busy")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(path.with_suffix(".lock")):
            try:
                kept = read(path.read_bytes())
                if not _expired(busy):
                    return kept, True
            except (OSError, ValueError, KeyError, TypeError):
                pass
            decided, others = watch(measure)
            partial = path.with_suffix(".partial")
            partial.write_bytes(encode(decided))
            partial.replace(path)
            if others is not None and others > BUSY_SHARE:
                busy.write_text(f"{others:.3f}\n")
                log.warning(
                    f"{what} measured while other processes took {others:.0%} of the "
                    f"CPUs: starts in the next {BUSY_KEPT_S} s read it, later ones measure again",
                    path=str(path),
                )
            else:
                busy.unlink(missing_ok=True)
            return decided, False
    except OSError as exc:  # a read-only models folder
        log.warning(f"{what} not kept", path=str(path), error=str(exc))
        return measure(), False


def _expired(busy: Path) -> bool:
    """Whether ``busy`` marks a decision measured on a busy machine long enough ago
    that a start now measures again."""
    try:
        return time.time() - busy.stat().st_mtime > BUSY_KEPT_S
    except FileNotFoundError:
        return False


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

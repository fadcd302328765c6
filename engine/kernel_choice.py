"""Which packed GEMM each projection shape runs, Sluice's own or torch's: measured once
per machine and model, kept, and said.

Sluice's ``planes_mm`` (int8 activations, integer dot products) and torch's
``_weight_int4pack_mm_for_cpu`` (bfloat16 activations) trade places by CPU. Where the
CPU multiplies bfloat16 in hardware (AVX512-BF16: an AMD Zen 4), torch's kernel ran
SmolLM2's one-plane decode-step shapes about as fast as Sluice's (a decode step ×0.92
at one row, ×1.03–1.09 at 2–16); on AVX2 alone (that Zen 4 told to dispatch as an AVX2
CPU) Sluice's made the step ×1.12–1.39 faster, and its one 8-bit dot product for a
two-plane type won Gemma 3's steps ×1.06–1.50 natively (docs/benchmarks.md). So each
distinct shape (out, in, planes) is built both ways and timed at ``ROWS`` rows, from
emptied caches, interleaved sample by sample, in two passes (each kernel's faster one
kept), and Sluice's own takes the shape only where it is ``MARGIN`` faster summed over
those rows. The outcome is kept beside the precision decision, keyed by the CPU, the
torch build, threads, the kernel's build, the activations' dtype and the shapes, and
reused by every later start.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import structlog
import torch

from .cpu import host_cpu
from .gguf_blocks import Plane
from .gguf_packed import Int4Projections, packed_projections
from .native_kernels import build_key, planes_kernel
from .packed_rows import CacheFlush, Shape
from .plane_kernels import KERNELS, OwnPlanes, TorchPlanes
from .precision import cpu_key, kept_decision

log = structlog.get_logger(__name__)

ROWS = (1, 4)  # a decode step's rows, where the packed kernels serve
REPEATS = 5  # timed samples of each kernel at each count (medians), after a warm-up
PASSES = 2
MARGIN = 1.05  # how much faster Sluice's own must be to take a shape from torch's
NAMES = {"own": OwnPlanes.name, "torch": TorchPlanes.name}
Timer = Callable[[list[Plane], torch.dtype], dict[str, float]]


@dataclass(frozen=True)
class KernelChoice:
    """Each projection shape's kernel (``own`` or ``torch``) and why."""

    kernels: dict[Shape, str] = field(default_factory=dict)
    reason: str = "not measured"

    def to_dict(self) -> dict[str, object]:
        return {
            "reason": self.reason,
            "shapes": [
                {"out": o, "in": i, "planes": p, "kernel": NAMES[kernel]}
                for (o, i, p), kernel in sorted(self.kernels.items())
            ],
        }


@torch.inference_mode()
def time_kernels(planes: list[Plane], dtype: torch.dtype) -> dict[str, float]:
    """Seconds each kernel takes over ``ROWS`` (medians from emptied caches, summed)."""
    built = {name: make(planes) for name, make in KERNELS.items()}
    flush = CacheFlush()
    total = dict.fromkeys(built, 0.0)
    for rows in ROWS:
        x = torch.randn(rows, planes[0].codes.shape[1], dtype=dtype)
        times: dict[str, list[float]] = {name: [] for name in built}
        for repeat in range(REPEATS + 1):
            for name, kernel in built.items():
                flush()
                begin = time.perf_counter()
                kernel.product(x)
                if repeat:
                    times[name].append(time.perf_counter() - begin)
        for name in built:
            total[name] += statistics.median(times[name])
    return total


def faster(times: Mapping[str, float]) -> str:
    return "own" if times["own"] * MARGIN < times["torch"] else "torch"


def measure(
    by_shape: Mapping[Shape, Int4Projections], dtype: torch.dtype, timer: Timer = time_kernels
) -> dict[Shape, str]:
    best: dict[Shape, dict[str, float]] = {}
    for _ in range(PASSES):
        for shape, projection in sorted(by_shape.items()):
            assert projection.planes is not None
            times = timer(projection.planes, dtype)
            earlier = best.get(shape, times)
            best[shape] = {name: min(times[name], earlier[name]) for name in times}
    chosen = {shape: faster(times) for shape, times in best.items()}
    said = {"x".join(map(str, s)): f"{k} (own {t['own'] * 1e3:.3f} ms, torch "
            f"{t['torch'] * 1e3:.3f} ms)" for (s, k), t in zip(chosen.items(), best.values(),
                                                                 strict=True)}  # fmt: skip
    log.info("packed kernels measured", rows=ROWS, out_in_planes=said)
    return chosen


def choose_kernels(model: Any, cache_dir: Path | None, timer: Timer = time_kernels) -> KernelChoice:
    """Give each packed projection of ``model`` that has none its kernel: torch's where
    Sluice's own is not built here, else by shape from the kept decision for this
    machine or a new measurement (kept in ``cache_dir``; None measures without keeping)."""
    projections = [p for p in packed_projections(model) if p.kernel is None]
    by_shape: dict[Shape, Int4Projections] = {}
    for projection in projections:
        by_shape.setdefault(projection.shape, projection)
    unavailable = planes_kernel()
    if not by_shape:
        choice = KernelChoice()
    elif unavailable is not None:
        choice = KernelChoice(dict.fromkeys(by_shape, "torch"), f"own unavailable: {unavailable}")
    else:
        dtype = next(iter(by_shape.values())).dense.dtype
        if cache_dir is None:
            choice = KernelChoice(measure(by_shape, dtype, timer), "measured")
        else:
            name = cpu_key(host_cpu(), build=build_key(), dtype=str(dtype), shapes=sorted(by_shape))
            path = cache_dir / f"packed-kernels-v1-{name}.json"
            choice = _kept(path, lambda: measure(by_shape, dtype, timer))
    for projection in projections:
        projection.use(KERNELS[choice.kernels[projection.shape]])
    return choice


def _kept(path: Path, measure: Callable[[], dict[Shape, str]]) -> KernelChoice:
    def read(kept: bytes) -> dict[Shape, str]:
        return {(e["out"], e["in"], e["planes"]): e["kernel"] for e in orjson.loads(kept)}

    def encode(kernels: dict[Shape, str]) -> bytes:
        return orjson.dumps([{"out": o, "in": i, "planes": p, "kernel": k}
                             for (o, i, p), k in sorted(kernels.items())])  # fmt: skip

    kernels, earlier = kept_decision(path, read, measure, encode, "packed kernels")
    return KernelChoice(kernels, "measured earlier" if earlier else "measured")

"""Up to how many rows each packed GGUF projection multiplies packed: measured once per
machine and model, kept, and said.

The packed int4 GEMM reads a quarter of a bf16 weight's bytes (half for a two-plane
Q5_0 / Q8_0) but de-quantises each group as it goes, so the dense de-quantised weight
overtakes it as rows grow. Where depends on the CPU: on an AMD Zen 4 (AVX512-BF16) a
packed SmolLM2 step stayed ahead at 16 rows (×1.23) and fell behind at 64; on an Intel
Sapphire Rapids, whose AMX multiplies bf16 fast, Gemma 3's shapes turned at 8 rows for
one plane (int4 59 ms against bf16's 36 at 16 rows, docs/benchmarks.md), and a server
fixed at 32 served Gemma 3 at C=16 at 0.67× llama-server's speed. So each distinct
projection shape (out, in, planes) is timed packed against dense at ``CANDIDATE_ROWS``
(the LM head's to ``HEAD_ROWS``; medians of interleaved repeats, after a warm-up, in
two passes a shape apart, each kernel's faster pass kept: a burst of other work during
one pass does not decide), and its limit is the largest count up to which dense was
not faster by ``MARGIN`` at any count. Each timed product starts with the caches
emptied (``CacheFlush``): in a decode step every weight is read once and the model is
larger than the last-level cache, so both kernels read their weights from memory; timed
warm, a shape's fp32 weight of a few MB sat in the cache, and on an AVX2 EPYC (32 MB
L3) dense fp32 "won" at one row on shapes where, streamed from memory, it reads four
times the packed kernel's bytes. A near-tie keeps the packed kernel: on one VM, ties
decided by noise alone had given one shape's limit as 16 in one measurement and 0 in
the next. The outcome is kept beside the precision decision, keyed by the CPU, torch
build, threads, the dense weights' dtype and layout (``prepacked_dense``) and the
shapes, and reused by every later start (servers starting together wait for the first
one's measurement).
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
from .fused_projections import ProjectionMember
from .gguf_packed import PACKED_MAX_ROWS, Int4Projections, packed_projections
from .native_kernels import build_key
from .plane_kernels import OwnPlanes
from .precision import cpu_key, kept_decision

log = structlog.get_logger(__name__)

# Past the unmeasured limit too, and through prompt chunks: the blocks of
# ``blocks_mm.cpp`` stayed ahead of dense bfloat16 at 64 rows on a Zen 4 (Gemma 3's head
# 66 against 77 ms), and with AVX-512 VNNI alone (an Intel Xeon with AMX turned off for
# both kernels) by 1.5–2.8× at 128–1024 rows too. 1024 holds a step of the scheduler's
# default 512-token prompt chunk and its decoding rows beside it.
CANDIDATE_ROWS = (1, 2, 4, 8, 16, PACKED_MAX_ROWS, 64, 128, 256, 512, 1024)
# The LM head multiplies only each sequence's last position (at most the default
# --max-running-requests, 64, a step), and one product of Gemma 3's 262 144 rows at
# 1024 would take about a second on a Zen 4 (70 ms at 64): it is timed to this many.
HEAD_ROWS = 64
REPEATS = 7  # timed samples of each kernel at each count (medians), after a warm-up
# Bytes read between timed products to empty the caches: twice the last-level cache
# where the system says its size, else this.
FLUSH_BYTES = 64 << 20
PASSES = 2  # measurements of every shape, one after another
MARGIN = 1.1  # how much faster dense must be at a count to take it from packed
Shape = tuple[int, int, int]  # (out, in, planes)
Timer = Callable[[Int4Projections, int], tuple[float, float]]


@dataclass(frozen=True)
class PackedRows:
    """Each projection shape's limit and where it came from (``measured``, ``measured
    earlier``, or ``not measured``: the default limit)."""

    limits: dict[Shape, int] = field(default_factory=dict)
    reason: str = "not measured"

    def to_dict(self) -> dict[str, object]:
        return {
            "reason": self.reason,
            "limits": [
                {"out": o, "in": i, "planes": p, "max_rows": rows}
                for (o, i, p), rows in sorted(self.limits.items())
            ],
        }


def dense_wins(packed: float, dense: float) -> bool:
    return packed > dense * MARGIN


def largest_packed_rows(times: Mapping[int, tuple[float, float]]) -> int:
    """The largest row count up to which dense (second) was not ``MARGIN`` faster than
    packed (first) at any count measured; 0 where it was from one row."""
    limit = 0
    for rows in sorted(times):
        if dense_wins(*times[rows]):
            break
        limit = rows
    return limit


CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache_bytes(caches: Path = CPU_CACHES) -> int | None:
    """The largest CPU cache's size as Linux reports it (``32768K``; None where it does
    not)."""
    sizes = []
    for path in caches.glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KM")) * scale)
        except (OSError, ValueError):
            continue
    return max(sizes, default=None)


class CacheFlush:
    """Reads a buffer larger than the last-level cache, evicting what a product before
    left there (its weights, its input)."""

    def __init__(self) -> None:
        cache = last_level_cache_bytes()
        size = 2 * cache if cache else FLUSH_BYTES
        self.buffer = torch.ones(size // 4, dtype=torch.float32)

    def __call__(self) -> None:
        self.buffer.sum()


@torch.inference_mode()
def time_products(projection: Int4Projections, rows: int) -> tuple[float, float]:
    """Median seconds of a packed and a dense product at ``rows`` rows, each from
    emptied caches, interleaved sample by sample, after one warm-up sample of each."""
    x = torch.randn(rows, projection.shape[1], dtype=projection.dense.dtype)
    kernels = (projection.packed_product, projection.dense_product)
    flush = CacheFlush()
    times: list[list[float]] = [[], []]
    for repeat in range(REPEATS + 1):
        for k, kernel in enumerate(kernels):
            flush()
            begin = time.perf_counter()
            kernel(x)
            if repeat:
                times[k].append(time.perf_counter() - begin)
    return statistics.median(times[0]), statistics.median(times[1])


def measure_curve(
    projection: Int4Projections,
    timer: Timer = time_products,
    earlier: Mapping[int, tuple[float, float]] | None = None,
    top: int = CANDIDATE_ROWS[-1],
) -> dict[int, tuple[float, float]]:
    """The shape's times from one row up to ``top``, stopping where dense first wins;
    each kernel's time the faster of this pass and ``earlier``'s (an earlier pass)."""
    times: dict[int, tuple[float, float]] = {}
    for rows in (r for r in CANDIDATE_ROWS if r <= top):
        packed, dense = timer(projection, rows)
        if earlier is not None and rows in earlier:
            packed, dense = min(packed, earlier[rows][0]), min(dense, earlier[rows][1])
        times[rows] = packed, dense
        if dense_wins(packed, dense):
            break
    return times


def measure_limits(
    by_shape: Mapping[Shape, Int4Projections],
    timer: Timer = time_products,
    head: Shape | None = None,
) -> dict[Shape, int]:
    """Each shape's limit from ``PASSES`` passes over every shape (``head``, the LM
    head's, timed to ``HEAD_ROWS``)."""
    curves: dict[Shape, dict[int, tuple[float, float]]] = {}
    for _ in range(PASSES):
        for shape, projection in sorted(by_shape.items()):
            top = HEAD_ROWS if shape == head else CANDIDATE_ROWS[-1]
            curves[shape] = measure_curve(projection, timer, curves.get(shape), top)
    return {shape: largest_packed_rows(curve) for shape, curve in curves.items()}


def calibrate(model: Any, cache_dir: Path | None, timer: Timer = time_products) -> PackedRows:
    """Set ``max_rows`` on each packed projection of ``model`` from the kept decision
    for this machine and these shapes, or from a new measurement (kept in
    ``cache_dir``; None measures without keeping)."""
    projections = packed_projections(model)
    if not projections:
        return PackedRows()
    by_shape: dict[Shape, Int4Projections] = {}
    for projection in projections:
        by_shape.setdefault(projection.shape, projection)
    dense = next(iter(by_shape.values())).dense
    dense_form = f"{dense.dtype}{'-onednn' if dense.is_mkldnn else ''}"

    def measure() -> dict[Shape, int]:
        limits = measure_limits(by_shape, timer, head_shape(model))
        said = {"x".join(map(str, shape)): rows for shape, rows in limits.items()}
        log.info("packed rows measured", out_in_planes=said)
        return limits

    if cache_dir is None:
        chosen = PackedRows(measure(), "measured")
    else:
        kernels = sorted((shape, type(p.kernel).__name__) for shape, p in by_shape.items())
        # Sluice's own kernels' build (their sources): a change to them measures again.
        own = build_key() if any(isinstance(p.kernel, OwnPlanes) for p in projections) else ""
        name = cpu_key(host_cpu(), dtype=dense_form, shapes=sorted(by_shape), kernels=kernels,
                       own_kernels=own)  # fmt: skip
        # The version moves whenever how the limits are measured changes (now: two
        # passes and a margin, from emptied caches, keyed by each shape's packed kernel
        # and the dense layout, timed to 1024 rows), so earlier decisions are measured
        # again.
        chosen = _kept(cache_dir / f"packed-rows-v5-{name}.json", measure)
    apply_limits(model, chosen.limits)
    return chosen


def head_shape(model: Any) -> Shape | None:
    """The packed LM head's shape, where the model has one."""
    outputs = getattr(model, "get_output_embeddings", None)
    head = outputs() if outputs is not None else None
    if isinstance(head, ProjectionMember) and isinstance(head.shared, Int4Projections):
        return head.shared.shape
    return None


def apply_limits(model: Any, limits: Mapping[Shape, int]) -> None:
    """Set each packed projection's ``max_rows`` from its shape's limit (a decision
    kept, or one a server reports in ``/server_info``)."""
    for projection in packed_projections(model):
        projection.max_rows = limits[projection.shape]


def _kept(path: Path, measure: Callable[[], dict[Shape, int]]) -> PackedRows:
    def read(kept: bytes) -> dict[Shape, int]:
        return {(e["out"], e["in"], e["planes"]): e["max_rows"] for e in orjson.loads(kept)}

    def encode(limits: dict[Shape, int]) -> bytes:
        return orjson.dumps(PackedRows(limits).to_dict()["limits"])

    limits, earlier = kept_decision(path, read, measure, encode, "packed rows")
    return PackedRows(limits, "measured earlier" if earlier else "measured")

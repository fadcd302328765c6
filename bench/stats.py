"""Latency and throughput statistics shared by every bench (HTTP load generator, engine-only).

Kept free of aiohttp so that a bench without HTTP computes its numbers with exactly the
same code, and a ratio between two benches compares like with like.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0–100), interpolating linearly between closest ranks.

    Same definition as numpy's default, so numbers match other tools' reports.
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ratio(a: float | None, b: float | None) -> float | None:
    """a ÷ b, or None when either side is missing or b is zero (no number beats a fake one)."""
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


@dataclass(frozen=True)
class LatencySummary:
    """Distribution of one latency (seconds)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencySummary | None:
        """Summarise values, or None when there are none (e.g. every request failed)."""
        if not values:
            return None
        return cls(
            count=len(values),
            mean=math.fsum(values) / len(values),
            p50=percentile(values, 50),
            p90=percentile(values, 90),
            p99=percentile(values, 99),
            max=max(values),
        )

    def to_dict(self) -> dict[str, float]:
        return {
            "count": self.count,
            "mean": self.mean,
            "p50": self.p50,
            "p90": self.p90,
            "p99": self.p99,
            "max": self.max,
        }


@dataclass(frozen=True)
class RequestRecord:
    """What one request measured; `error` is None for a request that completed correctly."""

    error: str | None
    latency_s: float
    ttft_s: float | None = None
    itl_s: Sequence[float] = ()
    output_tokens: int = 0


@dataclass(frozen=True)
class RunResult:
    """One run (one system, one concurrency level): the numbers PERFORMANCE.md asks for."""

    label: str
    concurrency: int
    requests: int
    errors: int
    error_messages: list[str]
    wall_s: float
    output_tokens: int
    req_per_s: float
    output_tok_per_s: float
    tokens_per_request: float
    ttft: LatencySummary | None
    itl: LatencySummary | None
    records: list[RequestRecord] = field(default_factory=list, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready numbers (seconds), without the per-request records."""
        return {
            "label": self.label,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "errors": self.errors,
            "error_messages": self.error_messages,
            "wall_s": self.wall_s,
            "output_tokens": self.output_tokens,
            "req_per_s": self.req_per_s,
            "output_tok_per_s": self.output_tok_per_s,
            "tokens_per_request": self.tokens_per_request,
            "ttft_s": self.ttft.to_dict() if self.ttft else None,
            "itl_s": self.itl.to_dict() if self.itl else None,
        }


MAX_ERROR_MESSAGES = 5


def summarise(
    records: Iterable[RequestRecord], wall_s: float, *, label: str, concurrency: int
) -> RunResult:
    """Reduce per-request records to a RunResult.

    Rates count only requests that completed correctly, so a server that fails fast does
    not look fast. ITL pools every gap of every request, as vLLM's bench does.
    """
    records = list(records)
    ok = [r for r in records if r.error is None]
    failed = [r.error for r in records if r.error is not None]
    tokens = sum(r.output_tokens for r in ok)
    return RunResult(
        label=label,
        concurrency=concurrency,
        requests=len(records),
        errors=len(failed),
        error_messages=failed[:MAX_ERROR_MESSAGES],
        wall_s=wall_s,
        output_tokens=tokens,
        req_per_s=len(ok) / wall_s if wall_s > 0 else 0.0,
        output_tok_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        tokens_per_request=tokens / len(ok) if ok else 0.0,
        ttft=LatencySummary.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl=LatencySummary.of([gap for r in ok for gap in r.itl_s]),
        records=records,
    )


def pool(results: Sequence[RunResult], *, label: str) -> RunResult:
    """Merge repeated runs of one system at one level (interleaved rounds) into one result.

    Rates are total work over total wall time, percentiles over all pooled samples.
    """
    if not results:
        raise ValueError("pool of no results")
    return summarise(
        [rec for res in results for rec in res.records],
        math.fsum(res.wall_s for res in results),
        label=label,
        concurrency=results[0].concurrency,
    )


def _pct(summary: LatencySummary | None, attr: str) -> float | None:
    return getattr(summary, attr) if summary is not None else None


RATIO_METRICS: dict[str, Callable[[RunResult], float | None]] = {
    "output_tok_per_s": lambda r: r.output_tok_per_s,
    "req_per_s": lambda r: r.req_per_s,
    "ttft_p50": lambda r: _pct(r.ttft, "p50"),
    "ttft_p99": lambda r: _pct(r.ttft, "p99"),
    "itl_p50": lambda r: _pct(r.itl, "p50"),
    "itl_p99": lambda r: _pct(r.itl, "p99"),
}


def compare_results(a: RunResult, b: RunResult) -> dict[str, float | None]:
    """A ÷ B for every reported metric (higher is better for rates, lower for latencies)."""
    return {name: ratio(get(a), get(b)) for name, get in RATIO_METRICS.items()}

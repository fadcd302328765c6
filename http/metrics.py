"""``GET /metrics``: Prometheus text exposition (format 0.0.4), written by hand.

The HTTP layer records request counts and latencies into a ``Metrics`` registry;
engine and front-door numbers are read from their snapshots at scrape time.
"""

from __future__ import annotations

import asyncio
import math
import time
from bisect import bisect_left
from collections.abc import Iterable
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from sluice.engine.interface import EngineStats
from sluice.events.types import Delta, LifecycleEvent, ToolCall

if TYPE_CHECKING:
    from sluice.http.state import Lifecycle

Labels = tuple[str, ...]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Labels, values: Labels, extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return str(value) if isinstance(value, int) else repr(float(value))


def _header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


class Counter:
    def __init__(self, name: str, help_text: str, labels: Labels = ()) -> None:
        self.name, self.help, self.labels = name, help_text, labels
        self._values: dict[Labels, int] = {}

    def inc(self, *labels: str, amount: int = 1) -> None:
        self._values[labels] = self._values.get(labels, 0) + amount

    def lines(self) -> list[str]:
        lines = _header(self.name, "counter", self.help)
        for labels, value in sorted(self._values.items()):
            lines.append(f"{self.name}{_labels(self.labels, labels)} {value}")
        return lines


class _Series:
    __slots__ = ("counts", "sum")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * (buckets + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0


class Histogram:
    def __init__(
        self, name: str, help_text: str, buckets: Iterable[float], labels: Labels = ("route",)
    ) -> None:
        self.name, self.help, self.labels = name, help_text, labels
        self.bounds = tuple(sorted(float(b) for b in buckets))
        self._series: dict[Labels, _Series] = {}

    def observe(self, value: float, *labels: str) -> None:
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = _Series(len(self.bounds))
        series.counts[bisect_left(self.bounds, value)] += 1  # first bound >= value: ``le``
        series.sum += value

    def lines(self) -> list[str]:
        lines = _header(self.name, "histogram", self.help)
        for labels, series in sorted(self._series.items()):
            cumulative = 0
            for bound, count in zip((*self.bounds, math.inf), series.counts, strict=True):
                cumulative += count
                le = _labels(self.labels, labels, f'le="{_number(bound)}"')
                lines.append(f"{self.name}_bucket{le} {cumulative}")
            tail = _labels(self.labels, labels)
            lines.append(f"{self.name}_sum{tail} {_number(series.sum)}")
            lines.append(f"{self.name}_count{tail} {cumulative}")
        return lines


class Metrics:
    """What the HTTP layer records; one registry per server."""

    def __init__(self) -> None:
        self.requests = Counter(
            "sluice_requests_total",
            "HTTP requests answered, by route and status (499: the client left first).",
            ("route", "status"),
        )
        self.ttft = Histogram(
            "sluice_time_to_first_token_seconds",
            "From the request's start (queueing included) to its first generated text.",
            (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.itl = Histogram(
            "sluice_inter_token_latency_seconds",
            "Between a request's successive batches of generated text (one per engine step).",
            (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.e2e = Histogram(
            "sluice_e2e_request_latency_seconds",
            "From the start to the end of a generation request answered with 200.",
            (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.queue_time = Histogram(
            "sluice_queue_time_seconds",
            "Time a generation request waited for admission.",
            (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60),
        )

    def render(self, stats: EngineStats, queued: int, admitted: int) -> str:
        lines = self.requests.lines()
        for histogram in (self.ttft, self.itl, self.e2e, self.queue_time):
            lines += histogram.lines()
        snapshot = (
            ("sluice_running_sequences", "gauge", "Sequences in the engine's batch.",
             stats.running),
            ("sluice_waiting_sequences", "gauge", "Sequences submitted, waiting in the engine.",
             stats.waiting),
            ("sluice_queued_requests", "gauge", "Requests waiting at the front door.", queued),
            ("sluice_admitted_sequences", "gauge",
             "Sequences holding front-door slots (admitted, not yet finished).", admitted),
            ("sluice_kv_cache_usage_bytes", "gauge", "Memory held by the KV cache.",
             stats.kv_cache_bytes),
            ("sluice_engine_steps_total", "counter", "Engine steps run.", stats.steps),
            ("sluice_mixed_steps_total", "counter",
             "Engine steps that ran prompt chunks and decode rows in one packed forward.",
             stats.mixed_steps),
            ("sluice_spec_draft_tokens_total", "counter",
             "Draft tokens verified by speculative decoding.", stats.draft_tokens),
            ("sluice_spec_accepted_tokens_total", "counter",
             "Draft tokens kept: equal to the token sampled at their position.",
             stats.accepted_tokens),
            ("sluice_prompt_tokens_total", "counter", "Prompt tokens processed.",
             stats.prompt_tokens),
            ("sluice_generation_tokens_total", "counter", "Tokens sampled.",
             stats.generated_tokens),
            ("sluice_prefix_cache_hit_tokens_total", "counter",
             "Prompt tokens reused from the prefix cache.", stats.cached_tokens),
        )  # fmt: skip
        for name, kind, help_text, value in snapshot:
            lines += [*_header(name, kind, help_text), f"{name} {value}"]
        if stats.workers:  # --dp-size: each engine worker, by rank
            per_worker = (
                ("sluice_dp_worker_up", "gauge", "Whether the engine worker is serving.",
                 lambda w: int(w.up)),
                ("sluice_dp_running_sequences", "gauge", "Sequences in the worker's batch.",
                 lambda w: w.running),
                ("sluice_dp_waiting_sequences", "gauge", "Sequences waiting in the worker.",
                 lambda w: w.waiting),
                ("sluice_dp_worker_restarts_total", "counter",
                 "Times the front end started the worker again after it exited.",
                 lambda w: w.restarts),
                ("sluice_dp_routed_sequences_total", "counter",
                 "Sequences the front end sent the worker.", lambda w: w.routed),
                ("sluice_dp_prompt_tokens_total", "counter",
                 "Prompt tokens the worker processed since it last started.",
                 lambda w: w.prompt_tokens),
                ("sluice_dp_prefix_cache_hit_tokens_total", "counter",
                 "Of them, tokens reused from the worker's prefix cache.",
                 lambda w: w.cached_tokens),
            )  # fmt: skip
            for name, kind, help_text, read in per_worker:
                lines += _header(name, kind, help_text)
                lines += [f'{name}{{dp_rank="{w.rank}"}} {read(w)}' for w in stats.workers]
        return "\n".join(lines) + "\n"


def _generated(event: LifecycleEvent) -> bool:
    return isinstance(event, ToolCall) or (isinstance(event, Delta) and not event.is_prompt)


class TokenTimer:
    """TTFT and inter-token latency of one request: a clock read per batch with text."""

    def __init__(self, metrics: Metrics, route: str, started: float) -> None:
        self.metrics, self.route = metrics, route
        self.last = started
        self.first = True

    def batch(self, batch: list[LifecycleEvent]) -> None:
        if not any(map(_generated, batch)):
            return
        now = time.perf_counter()
        histogram = self.metrics.ttft if self.first else self.metrics.itl
        histogram.observe(now - self.last, self.route)
        self.first, self.last = False, now


def _route(request: web.Request) -> str:
    """The route's pattern, not the path: unknown paths must not grow the label set."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def count_requests(metrics: Metrics) -> Middleware:
    """Counts every answer by route and status; the outermost middleware, so it sees
    the status that left, whatever answered."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            metrics.requests.inc(_route(request), str(status))

    return middleware


def metrics_endpoint(lifecycle: Lifecycle) -> Handler:
    """``GET /metrics``; answers while loading and draining too (zeros before load)."""

    async def handle(request: web.Request) -> web.Response:
        state = lifecycle.loaded
        stats = state.pipeline.engine.stats() if state is not None else EngineStats()
        admission = state.admission if state is not None else None
        text = lifecycle.metrics.render(
            stats,
            queued=admission.queued if admission is not None else 0,
            admitted=admission.running if admission is not None else 0,
        )
        return web.Response(
            text=text,
            headers={"Content-Type": CONTENT_TYPE, "X-Content-Type-Options": "nosniff"},
        )

    return handle

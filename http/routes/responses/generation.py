"""One response being generated: its pipeline run and projection, the store it is
saved in, and the structlog trace of its lifecycle."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import orjson

from sluice.events.types import ErrorInfo, Failed, LifecycleEvent, terminal_of
from sluice.http.metrics import TokenTimer
from sluice.http.output import ResponseOutput
from sluice.http.projections.response_events import Event
from sluice.http.projections.responses import TERMINAL_EVENTS, ResponsesProjection
from sluice.http.protocol.response_items import item_text
from sluice.http.protocol.responses import ResponsesRequest
from sluice.http.routes.responses.service import ROUTE, ResponsesService
from sluice.http.state import ServerState
from sluice.http.store import UNFINISHED, ResponseStore
from sluice.pipeline.runner import RequestRun

ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs", "compaction": "cmp"}  # fmt: skip


def frame(event_type: str, data: bytes) -> bytes:
    """One SSE event: ``event:`` names it (as ``data.type``), ``data:`` is its JSON."""
    return b"event: " + event_type.encode() + b"\ndata: " + data + b"\n\n"


def frame_of(data: bytes) -> bytes:
    return frame(orjson.loads(data)["type"], data)


Sink = Callable[[list[tuple[str, bytes]]], Awaitable[None]]
"""Where a batch of stream events goes, each as its type and its JSON."""


def sse_sink(output: ResponseOutput) -> Sink:
    """The events as SSE, one write per batch."""

    async def write(events: list[tuple[str, bytes]]) -> None:
        await output.write(b"".join(frame(kind, data) for kind, data in events))

    return write


class IdMaker:
    """Item ids derived from the response id, so a replay names items the same way."""

    def __init__(self, response_id: str) -> None:
        self.stem = response_id.removeprefix("resp_")
        self.counts: dict[str, int] = {}

    def __call__(self, prefix: str) -> str:
        n = self.counts.get(prefix, 0)
        self.counts[prefix] = n + 1
        return f"{prefix}_{self.stem}{n:04x}"


@dataclass
class Generation:
    """One response being generated: pipeline run, projection, store and trace."""

    service: ResponsesService
    state: ServerState
    req: ResponsesRequest
    run: RequestRun
    projection: ResponsesProjection
    response_id: str
    started: float
    trace: Any
    error: ErrorInfo | None = None
    ttft: float | None = None

    @property
    def store(self) -> ResponseStore | None:
        return self.service.store if self.req.store else None

    def _seconds(self) -> float:
        return round(time.perf_counter() - self.started, 4)

    async def save(self) -> None:
        """The response as it stands (and, once it ended, its output items)."""
        if self.store is None:
            return
        body = self.projection.fold.response or self.projection.snapshot(self.projection.status)
        status = body["status"]
        final = status not in UNFINISHED
        await self.store.update(
            self.response_id,
            status=status,
            body=orjson.dumps(body),
            output_items=body["output"] if final else None,
        )

    async def publish(self, events: list[Event], sink: Sink | None) -> None:
        """Log, store and hand on one batch of stream events."""
        if not events:
            return
        encoded = [orjson.dumps(e) for e in events]
        if self.store is not None:
            await self.store.append_events(
                self.response_id,
                [(e["sequence_number"], data) for e, data in zip(events, encoded, strict=True)],
                at=time.time(),
            )
        for event in events:
            self._trace(event)
            if event["type"] in ("response.in_progress", *TERMINAL_EVENTS):
                await self.save()
        if sink is not None:
            await sink([(e["type"], d) for e, d in zip(events, encoded, strict=True)])

    def _trace(self, event: Event) -> None:
        kind = event["type"]
        if kind in ("response.output_text.delta", "response.reasoning_text.delta",
                    "response.function_call_arguments.delta"):  # fmt: skip
            if self.ttft is None:
                self.ttft = self._seconds()
                self.trace.info("response.first_token", seconds=self.ttft)
            return
        if kind == "response.in_progress":
            self.trace.info("response.in_progress", status="in_progress", seconds=self._seconds(),
                            prompt_tokens=len(self.run.prompt_ids[0]))  # fmt: skip
        elif kind == "response.output_item.done":
            item = event["item"]
            self.trace.info("response.output_item.done", item_id=item["id"], item_type=item["type"],
                            item_status=item.get("status"), seconds=self._seconds())  # fmt: skip
        elif kind == "error":
            self.trace.warning("response.error", message=event["message"], code=event["code"])
        elif kind in TERMINAL_EVENTS:
            body = event["response"]
            usage = body.get("usage") or {}
            extra = {}
            if self.service.trace_prompts:
                extra["output_text"] = "".join(item_text(i) for i in body["output"])
            self.trace.info(
                kind,
                status=body["status"],
                seconds=self._seconds(),
                ttft=self.ttft,
                input_tokens=usage.get("input_tokens"),
                cached_tokens=(usage.get("input_tokens_details") or {}).get("cached_tokens"),
                output_tokens=usage.get("output_tokens"),
                output_items=len(body["output"]),
                incomplete_reason=(body.get("incomplete_details") or {}).get("reason"),
                **extra,
            )

    async def pump(self, sink: Sink | None) -> None:
        """The pipeline's events, projected, until the response ends."""
        timer = TokenTimer(self.state.metrics, ROUTE, self.started)

        async def take(batch: list[LifecycleEvent]) -> None:
            timer.batch(batch)
            await self._take(batch, sink)

        await self.run.pump(take)

    async def _take(self, batch: list[LifecycleEvent], sink: Sink | None) -> None:
        end = terminal_of(batch)
        if isinstance(end, Failed):
            self.error = end.error
        await self.publish(self.projection.project(batch), sink)

    async def fail(self, error: ErrorInfo, sink: Sink | None) -> None:
        """The run ends with ``error`` (shutdown ran out of patience, never admitted):
        its ``Failed`` event, projected like any."""
        event = self.run.fail(error)
        if event is not None:
            await self._take([event], sink)

    async def cancelled(self, reason: str) -> None:
        """The run ends unfinished (cancel, client gone): its ``Cancelled`` event,
        projected (the stream has no event for it: it just ends), and the stored body."""
        with anyio.CancelScope(shield=True):
            event = self.run.cancel(reason)
            if event is not None:
                self.projection.project([event])
            self.trace.info("response.cancelled", status="cancelled", reason=reason,
                            seconds=self._seconds())  # fmt: skip
            await self.save()

    async def forget(self) -> None:
        """Never admitted: the client gets the error and no response, so none is kept."""
        if self.store is not None:
            with anyio.CancelScope(shield=True):
                await self.store.delete(self.response_id)
        self.trace.info("response.not_admitted", seconds=self._seconds())

"""An engine that plays back recorded engine events instead of running a model."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from sluice.engine.interface import EngineBackend, EngineStats, EventSink
from sluice.engine.params import SequenceSpec
from sluice.events.types import EngineEvent


class ReplayEngine(EngineBackend):
    """``EngineBackend`` over recordings: a submitted request gets its recorded batches,
    one per event-loop turn, in their recorded order and boundaries."""

    def __init__(self, batches_by_request: dict[str, list[list[EngineEvent]]], max_context: int):
        self._batches = batches_by_request
        self.max_context = max_context
        self.submitted: list[SequenceSpec] = []
        self._stats = EngineStats()

    def submit(self, specs: Sequence[SequenceSpec], sink: EventSink) -> None:
        self.submitted.extend(specs)
        request_ids = {spec.request_id for spec in specs}
        loop = asyncio.get_running_loop()
        for request_id in sorted(request_ids):
            for batch in self._batches.get(request_id, []):
                loop.call_soon(sink, batch)

    def cancel(self, request_id: str, choice_index: int | None = None) -> None:
        """Recorded events already show what the engine did after a cancellation."""

    def stats(self) -> EngineStats:
        return self._stats

    async def flush_cache(self) -> bool:
        """Nothing is cached: a recording replays the same whatever was flushed."""
        return True


class QueuedReplayEngine(EngineBackend):
    """``EngineBackend`` that plays queued recordings to requests in arrival order: the
    n-th request gets the n-th queued session's engine batches, re-addressed to its own
    request id. Serves live HTTP clients (whose request ids are new) from recordings."""

    def __init__(self, max_context: int) -> None:
        self.max_context = max_context
        self._queue: deque[list[list[EngineEvent]]] = deque()
        self.submitted: list[SequenceSpec] = []

    def push(self, batches: list[list[EngineEvent]]) -> None:
        self._queue.append(batches)

    def submit(self, specs: Sequence[SequenceSpec], sink: EventSink) -> None:
        self.submitted.extend(specs)
        request_id = specs[0].request_id
        loop = asyncio.get_running_loop()
        for batch in self._queue.popleft():
            loop.call_soon(sink, [replace(event, request_id=request_id) for event in batch])

    def cancel(self, request_id: str, choice_index: int | None = None) -> None:
        """The recording already holds what followed."""

    def stats(self) -> EngineStats:
        return EngineStats()

    async def flush_cache(self) -> bool:
        """Nothing is cached: recordings replay the same whatever was flushed."""
        return True

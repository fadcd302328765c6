"""Recording a request's whole event stream as JSONL, for replay.

One file per request: a ``Session`` header (route, request body, request id,
creation time, served model name, context length, the server flags that shape
the output and the clock readings it holds), then one ``EngineBatch``
line per batch of engine events exactly as the engine delivered them (batch
boundaries decide how text is chunked, so they are part of the record), then every
lifecycle event, and an ``Output`` line with the exact status and bytes the client
received.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio
import orjson

from .codec import event_from_dict, event_to_dict
from .types import (
    EngineEvent,
    LifecycleEvent,
    PromptProcessed,
    SequenceFinished,
    TokenSampled,
)


@dataclass
class Recording:
    route: str
    body: Any
    request_id: str
    created: int
    model_name: str
    context_length: int
    engine_batches: list[list[EngineEvent]] = field(default_factory=list)
    lifecycle_events: list[LifecycleEvent] = field(default_factory=list)
    output: bytes = b""
    status: int = 200
    # The server flags that shape a request's output beyond its body (chat template,
    # tool-call and reasoning parsers): replay sets them up the same way.
    server: dict[str, str] = field(default_factory=dict)
    # Clock readings the output holds (Responses' ``completed_at``), in the order they
    # were taken: inputs like ``created``, which replay gives back.
    clock: list[int] = field(default_factory=list)

    def read_clock(self) -> int:
        """Now, in whole seconds, kept for replay."""
        reading = int(time.time())
        self.clock.append(reading)
        return reading

    def add_engine_batch(self, events: Sequence[EngineEvent]) -> None:
        self.engine_batches.append(list(events))

    def to_jsonl(self) -> bytes:
        header = {
            "type": "Session",
            "route": self.route,
            "body": self.body,
            "request_id": self.request_id,
            "created": self.created,
            "model_name": self.model_name,
            "context_length": self.context_length,
        }
        if self.server:
            header["server"] = self.server
        if self.clock:
            header["clock"] = self.clock
        lines = [orjson.dumps(header)]
        lines.extend(
            orjson.dumps({"type": "EngineBatch", "events": [event_to_dict(e) for e in batch]})
            for batch in self.engine_batches
        )
        lines.extend(orjson.dumps(event_to_dict(e)) for e in self.lifecycle_events)
        output = {"type": "Output", "status": self.status, "body": self.output.decode("utf-8")}
        lines.append(orjson.dumps(output))
        return b"\n".join(lines) + b"\n"

    @classmethod
    def from_jsonl(cls, raw: bytes) -> Recording:
        lines = [orjson.loads(line) for line in raw.splitlines() if line.strip()]
        if not lines or lines[0].get("type") != "Session" or lines[-1].get("type") != "Output":
            raise ValueError("not a Sluice recording: expected a Session line first, Output last")
        head, tail = lines[0], lines[-1]
        rec = cls(
            head["route"],
            head["body"],
            head["request_id"],
            head["created"],
            head["model_name"],
            head["context_length"],
            output=tail["body"].encode("utf-8"),
            status=tail["status"],
            server=dict(head.get("server") or {}),
            clock=list(head.get("clock") or []),
        )
        for data in lines[1:-1]:
            if data["type"] == "EngineBatch":
                rec.engine_batches.append([_engine_event(d) for d in data["events"]])
            else:
                rec.lifecycle_events.append(_lifecycle_event(data))
        return rec


def _engine_event(data: dict[str, Any]) -> EngineEvent:
    event = event_from_dict(data)
    if not isinstance(event, PromptProcessed | TokenSampled | SequenceFinished):
        raise ValueError(f"expected an engine event, got {data['type']}")
    return event


def _lifecycle_event(data: dict[str, Any]) -> LifecycleEvent:
    event = event_from_dict(data)
    if isinstance(event, PromptProcessed | TokenSampled | SequenceFinished):
        raise ValueError(f"engine event {data['type']} outside an EngineBatch")
    return event


class Recorder(Protocol):
    """Where each finished recording goes."""

    async def save(self, recording: Recording) -> object: ...


class FileRecorder:
    """Writes each finished recording to ``<dir>/<request id>.jsonl`` off the event loop."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    async def save(self, recording: Recording) -> Path:
        path = self.directory / f"{recording.request_id}.jsonl"
        await anyio.to_thread.run_sync(path.write_bytes, recording.to_jsonl())
        return path


class MemoryRecorder:
    """Keeps the recordings (replay compares what a re-run records with the original)."""

    def __init__(self) -> None:
        self.saved: list[Recording] = []

    async def save(self, recording: Recording) -> Recording:
        self.saved.append(recording)
        return recording

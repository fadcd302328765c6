"""Recording a request's whole event stream as JSONL, for replay.

One file per request: a ``Session`` header (the API route, the request body, the
request id and creation time), every engine and lifecycle event in the order the
pipeline saw them, and an ``Output`` line with the exact bytes the client received.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import orjson

from .codec import event_from_dict, event_to_dict
from .types import EngineEvent, Event, LifecycleEvent


@dataclass
class Recording:
    route: str
    body: dict[str, Any]
    request_id: str
    created: int
    engine_events: list[EngineEvent] = field(default_factory=list)
    lifecycle_events: list[LifecycleEvent] = field(default_factory=list)
    output: bytes = b""
    status: int = 200

    def to_jsonl(self) -> bytes:
        lines = [
            orjson.dumps(
                {
                    "type": "Session",
                    "route": self.route,
                    "body": self.body,
                    "request_id": self.request_id,
                    "created": self.created,
                }
            )
        ]
        events: list[Event] = [*self.engine_events, *self.lifecycle_events]
        lines.extend(orjson.dumps(event_to_dict(e)) for e in events)
        lines.append(
            orjson.dumps(
                {"type": "Output", "status": self.status, "body": self.output.decode("utf-8")}
            )
        )
        return b"\n".join(lines) + b"\n"

    @classmethod
    def from_jsonl(cls, raw: bytes) -> Recording:
        lines = [orjson.loads(line) for line in raw.splitlines() if line.strip()]
        head, tail = lines[0], lines[-1]
        if head.get("type") != "Session" or tail.get("type") != "Output":
            raise ValueError("not a Sluice recording: expected a Session line first and Output last")
        rec = cls(head["route"], head["body"], head["request_id"], head["created"])
        for data in lines[1:-1]:
            event = event_from_dict(data)
            if isinstance(event, EngineEvent.__args__):  # type: ignore[attr-defined]
                rec.engine_events.append(event)  # type: ignore[arg-type]
            else:
                rec.lifecycle_events.append(event)  # type: ignore[arg-type]
        rec.output = tail["body"].encode("utf-8")
        rec.status = tail["status"]
        return rec


class Recorder:
    """Writes each finished recording to ``<dir>/<request id>.jsonl`` off the event loop."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    async def save(self, recording: Recording) -> Path:
        path = self.directory / f"{recording.request_id}.jsonl"
        await anyio.to_thread.run_sync(path.write_bytes, recording.to_jsonl())
        return path

"""The Responses service of one server: the store, the background tasks, and the live
runs that followers of a background response read."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field

import anyio
import orjson
import structlog
from aiohttp import web

from sluice.http.projections.responses import ResponsesProjection
from sluice.http.routes.responses.compaction_item import SECRET_NAME
from sluice.http.store import ResponseStore, SqliteResponseStore

ROUTE = "/v1/responses"

log = structlog.get_logger("sluice.responses")


class LiveRun:
    """A background response while its task runs: the events so far, for followers."""

    def __init__(self, projection: ResponsesProjection) -> None:
        self.projection = projection
        self.frames: list[bytes] = []
        self.done = False
        self.scope: anyio.CancelScope | None = None
        self.cancel_requested = False
        self.finished = anyio.Event()
        self._changed = anyio.Event()

    def publish(self, frames: Sequence[bytes]) -> None:
        self.frames.extend(frames)
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    def finish(self) -> None:
        self.done = True
        self._changed.set()
        self.finished.set()

    async def follow(self, after: int) -> AsyncIterator[bytes]:
        """Frames whose sequence number is greater than ``after``, live until the end."""
        index = max(after + 1, 0)
        while True:
            if index < len(self.frames):
                chunk = b"".join(self.frames[index:])
                index = len(self.frames)
                yield chunk
            elif self.done:
                return
            else:
                await self._changed.wait()


@dataclass
class ResponsesService:
    """The store, the background tasks and the live runs of one server."""

    store: ResponseStore
    trace_prompts: bool = False
    live: dict[str, LiveRun] = field(default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _compaction_key: bytes | None = None

    @classmethod
    def in_memory(cls) -> ResponsesService:
        return cls(SqliteResponseStore(":memory:"))

    async def start(self) -> None:
        """Responses a previous process left unfinished can never finish: mark them."""

        def interrupted(body: bytes, next_seq: int) -> tuple[str, bytes, bytes]:
            data = orjson.loads(body)
            data["status"] = "failed"
            data["error"] = {
                "code": "server_error",
                "message": "The server restarted before the response finished.",
            }
            event = {"type": "response.failed", "sequence_number": next_seq, "response": data}
            return "failed", orjson.dumps(data), orjson.dumps(event)

        count = await self.store.interrupt_unfinished(interrupted)
        if count:
            log.warning("unfinished responses marked failed after a restart", count=count)
        await self.store.watch_cancels(self._cancel_relayed)

    async def compaction_key(self) -> bytes:
        """The key that seals compaction items (the store's, shared by its front ends)."""
        if self._compaction_key is None:
            self._compaction_key = await self.store.secret(SECRET_NAME)
        return self._compaction_key

    def _cancel_relayed(self, response_id: str) -> None:
        """Another front end sharing the store was asked to cancel one of our runs."""
        live = self.live.get(response_id)
        if live is not None:
            self.spawn(cancel_live(live))

    def spawn(self, work: Awaitable[None]) -> None:
        async def run() -> None:
            await work

        task = asyncio.get_running_loop().create_task(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def wait_for_tasks(self) -> None:
        """Until every background task has finished (replay)."""
        if self.tasks:
            await asyncio.wait(list(self.tasks))

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=10)
        await self.store.close()


SERVICE_KEY = web.AppKey("sluice_responses", ResponsesService)


async def cancel_live(live: LiveRun) -> None:
    live.cancel_requested = True
    if live.scope is not None:
        live.scope.cancel()
    await live.finished.wait()

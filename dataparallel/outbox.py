"""Frames to one engine worker, written with the socket's flow control.

``EngineBackend.submit`` and ``cancel`` are called synchronously on the event loop,
so they cannot wait on a socket. They hand their frames to the worker's outbox; one
task writes them in order and waits on ``drain()`` after each write, so while the
worker reads slower than the front end sends (its loop busy, its socket full), frames
wait here, not in an ever-growing transport buffer. The sequences in them already
count in the worker's load (the front end's ``unreported``), so the router sends new
requests elsewhere and admission control answers 429 once every worker is that full.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

import structlog

log = structlog.get_logger(__name__)


class Outbox:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._frames: deque[bytes] = deque()
        self._ready = asyncio.Event()
        self._task = asyncio.create_task(self._write())

    @property
    def queued(self) -> int:
        """Frames not yet handed to the socket."""
        return len(self._frames)

    def send(self, frame: bytes) -> None:
        self._frames.append(frame)
        self._ready.set()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _write(self) -> None:
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                while self._frames:
                    # Everything queued goes in one write; then wait for room.
                    frames = list(self._frames)
                    self._frames.clear()
                    self.writer.writelines(frames)
                    await self.writer.drain()
        except ConnectionError as exc:
            # The worker is gone; its reader sees the same and fails its requests.
            log.debug("worker socket closed while writing", error=str(exc))

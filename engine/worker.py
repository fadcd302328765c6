"""An engine worker process (``--dp-size``): one engine, owned by this process, served
to the front end over the Unix socket the front end listens on.

The front end's frames arrive here in order (``engine.wire``); the engine's events go
back as one ``events`` frame per engine step: the engine delivers a step's batches in
one event-loop callback, and the frame is written in the callback after it. The
worker ends when the front end says ``stop`` or goes away (its socket closes).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from sluice.events.types import EngineEvent

from . import wire
from .interface import EngineBackend

log = structlog.get_logger(__name__)


async def serve_worker(
    engine: EngineBackend,
    socket_path: str,
    hello: dict[str, Any],
    *,
    stop: Callable[[], None] | None = None,
) -> None:
    """Serve ``engine`` (already started) until told to stop; ``stop`` ends it after."""
    reader, writer = await asyncio.open_unix_connection(socket_path)
    loop = asyncio.get_running_loop()
    pending: list[EngineEvent] = []
    flush_scheduled = False

    def flush() -> None:
        nonlocal flush_scheduled
        flush_scheduled = False
        if pending:
            writer.write(wire.events_frame(pending, engine.stats()))
            pending.clear()

    def sink(events: Sequence[EngineEvent]) -> None:
        nonlocal flush_scheduled
        pending.extend(events)
        if not flush_scheduled:
            flush_scheduled = True
            loop.call_soon(flush)

    writer.write(wire.frame("hello", **hello))
    try:
        while True:
            try:
                message = await wire.read_frame(reader)
            except asyncio.IncompleteReadError:
                log.warning("the front end went away: stopping")
                return
            kind = message["t"]
            if kind == "submit":
                engine.submit([wire.spec_from_dict(d) for d in message["specs"]], sink)
            elif kind == "cancel":
                engine.cancel(message["request_id"], message["choice_index"])
            elif kind == "flush":
                ok = await engine.flush_cache()
                writer.write(wire.frame("flushed", id=message["id"], ok=ok))
            elif kind == "stop":
                return
            else:
                raise wire.WireError(f"unknown frame kind {kind!r}")
            await writer.drain()
    finally:
        if stop is not None:
            await asyncio.to_thread(stop)  # the engine fails what is left: sent below
        await asyncio.sleep(0)  # let the engine's last delivery land in ``pending``
        flush()
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()

"""An engine worker process (``--dp-size``): one engine, owned by this process, served
to the front end over the Unix socket the front end listens on.

The worker connects first (``connect``) and is sent its engine config, which it loads
before it says ``hello``. Then the front end's frames arrive here in order (``wire``);
the engine's events go back as one ``events`` frame per engine step: the engine
delivers a step's batches in one event-loop callback, and the frame is written in the
callback after it. The worker ends when the front end says ``stop`` or goes away (its
socket closes).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from sluice.engine.interface import EngineBackend, EngineStats
from sluice.events.types import EngineEvent

from . import wire

log = structlog.get_logger(__name__)

STATS_INTERVAL_S = 0.05


@dataclass(frozen=True)
class Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    engine_config: dict[str, Any]  # ``EngineConfig.to_dict()``, settled by the front end


async def connect(socket_path: str) -> Connection:
    """Connect to the front end and take its first frame: the engine config."""
    reader, writer = await asyncio.open_unix_connection(socket_path)
    message = await wire.read_frame(reader)
    if message["t"] != "config":
        raise wire.WireError(f"the front end sent {message['t']!r} before the engine config")
    return Connection(reader, writer, message["engine"])


async def serve_worker(
    engine: EngineBackend,
    connection: Connection,
    hello: dict[str, Any],
    *,
    stop: Callable[[], None] | None = None,
) -> None:
    """Serve ``engine`` (already started) until told to stop; ``stop`` ends it after."""
    reader, writer = connection.reader, connection.writer
    loop = asyncio.get_running_loop()
    pending: list[EngineEvent] = []
    flush_scheduled = False
    received = 0  # sequences taken from submit frames
    reported: tuple[EngineStats, int] | None = None  # what the last frame said

    def send(stats: EngineStats) -> None:
        nonlocal reported
        writer.write(wire.events_frame(pending, stats, received))
        pending.clear()
        reported = (stats, received)

    def flush() -> None:
        nonlocal flush_scheduled
        flush_scheduled = False
        if pending:
            send(engine.stats())

    async def report_changes() -> None:
        """The engine settles its stats after a step's events went out (a finished
        sequence still counted as running): an idle worker would leave the front end
        routing by stale loads, so changed stats go out on their own."""
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            stats = engine.stats()
            if not pending and reported != (stats, received):
                send(stats)

    def sink(events: Sequence[EngineEvent]) -> None:
        nonlocal flush_scheduled
        pending.extend(events)
        if not flush_scheduled:
            flush_scheduled = True
            loop.call_soon(flush)

    writer.write(wire.frame("hello", **hello))
    reporter = asyncio.create_task(report_changes())
    try:
        while True:
            try:
                message = await wire.read_frame(reader)
            except asyncio.IncompleteReadError:
                log.warning("the front end went away: stopping")
                return
            kind = message["t"]
            if kind == "submit":
                specs = [wire.spec_from_dict(d) for d in message["specs"]]
                engine.submit(specs, sink)
                received += len(specs)
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
        reporter.cancel()
        if stop is not None:
            await asyncio.to_thread(stop)  # the engine fails what is left: sent below
        await asyncio.sleep(0)  # let the engine's last delivery land in ``pending``
        flush()
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()

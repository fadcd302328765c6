"""One front end over N engine worker processes (``--dp-size N``): the
``EngineBackend`` the pipeline sees, made real across a process boundary.

Each worker owns a model replica and its KV cache and talks to the front end over a
Unix socket (``wire``; ``worker`` is the other end), written through an ``Outbox``
that waits on the socket's flow control. A request's choices all go to one worker,
chosen by ``routing``. The front end supervises its workers: one that dies fails
only its own in-flight sequences (each gets a ``SequenceFinished`` with an error, so
streams end with an error frame and Responses become ``failed``), and is started
again with back-off while the others serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from sluice.engine.interface import EngineStats, EventSink, WorkerStats
from sluice.engine.params import SequenceSpec
from sluice.events.types import EngineEvent, PromptProcessed, SequenceFinished, TokenSampled

from . import wire
from .outbox import Outbox
from .routing import Balance, CacheAwareRouter, Load

log = structlog.get_logger(__name__)

WorkerCommand = Callable[[int, str], list[str]]
"""``(rank, socket_path) -> argv`` of one engine worker process."""

START_TIMEOUT_S = 900.0  # loading (and converting) a model can take minutes
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STOP_TIMEOUT_S = 15.0


class WorkerStartError(Exception):
    """A worker exited, or never said hello, before its first start completed."""


@dataclass
class _Request:
    sink: EventSink
    # choice index -> (last engine seq, tokens sampled): what a failure must report
    open: dict[int, tuple[int, int]]


@dataclass
class _Worker:
    rank: int
    proc: asyncio.subprocess.Process | None = None
    outbox: Outbox | None = None  # while connected
    up: bool = False
    stats: EngineStats = field(default_factory=EngineStats)
    sent: int = 0  # sequences sent in its current start
    received: int = 0  # of them, those its last stats frame counted
    routed: int = 0  # sequences sent, ever
    restarts: int = 0
    said_hello: bool = False  # in its current start
    requests: dict[str, _Request] = field(default_factory=dict)
    flushes: dict[int, asyncio.Future[bool]] = field(default_factory=dict)

    @property
    def unreported(self) -> int:
        """Sequences sent that its stats do not count yet (in flight on the socket)."""
        return self.sent - self.received


class DataParallelEngine:
    """``EngineBackend`` over ``size`` worker processes started by ``command``."""

    def __init__(
        self,
        command: WorkerCommand,
        size: int,
        *,
        config: dict[str, Any] | None = None,
        affinity: bool = True,
        balance: Balance | None = None,
        environment: Callable[[int], dict[str, str] | None] | None = None,
    ) -> None:
        self._command = command
        # Sent to each worker as it connects (``EngineConfig.to_dict()``).
        self._config = config or {}
        self._environment = environment
        self.size = size
        self.router = CacheAwareRouter(size, affinity=affinity, balance=balance)
        self._workers = [_Worker(rank) for rank in range(size)]
        self._owner: dict[str, int] = {}
        self._socket_dir = Path(tempfile.mkdtemp(prefix="sluice-dp-"))
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._flush_ids = itertools.count()
        self.max_context = 0
        self.hello: dict[str, Any] = {}  # rank 0's: what the model says of itself

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start every worker and wait until each has loaded its model (rank 0's hello
        is kept as ``hello``). Raises ``WorkerStartError``."""
        first: list[asyncio.Future[dict[str, Any]]] = []
        loop = asyncio.get_running_loop()
        for worker in self._workers:
            started: asyncio.Future[dict[str, Any]] = loop.create_future()
            first.append(started)
            self._tasks.append(asyncio.create_task(self._supervise(worker, started)))
        try:
            hellos = await asyncio.gather(*first)
        except BaseException:
            await self.close()
            raise
        self.hello = hellos[0]
        self.max_context = int(self.hello["context_length"])

    async def close(self) -> None:
        """Stop every worker (each fails what it still runs) and wait for them."""
        self._stopping = True
        for worker in self._workers:
            if worker.outbox is not None:
                worker.outbox.send(wire.frame("stop"))
            elif worker.proc is not None and worker.proc.returncode is None:
                worker.proc.terminate()  # still loading its model: nothing to drain
        procs = [w.proc for w in self._workers if w.proc is not None]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await asyncio.gather(*(p.wait() for p in procs))
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(OSError):
            for path in self._socket_dir.iterdir():
                path.unlink()
            self._socket_dir.rmdir()

    # ------------------------------------------------------------ EngineBackend

    def submit(self, specs: Sequence[SequenceSpec], sink: EventSink) -> None:
        if not specs:
            return
        request_id = specs[0].request_id
        loads = {
            w.rank: Load(w.stats.running, w.stats.waiting + w.unreported)
            for w in self._workers
            if w.up
        }
        if not loads:
            reason = "no engine worker is up"
            failed = [_failure(s.request_id, s.choice_index, (-1, 0), reason) for s in specs]
            asyncio.get_running_loop().call_soon(sink, failed)
            return
        rank = self.router.choose(specs[0].prompt_ids, loads, specs[0].routing_key)
        worker = self._workers[rank]
        self.router.sent(rank, specs[0].prompt_ids)
        worker.requests[request_id] = _Request(sink, {s.choice_index: (-1, 0) for s in specs})
        worker.sent += len(specs)
        worker.routed += len(specs)
        self._owner[request_id] = rank
        assert worker.outbox is not None
        worker.outbox.send(wire.submit_frame(specs))

    def cancel(self, request_id: str, choice_index: int | None = None) -> None:
        rank = self._owner.get(request_id)
        if rank is None:
            return
        worker = self._workers[rank]
        if worker.up and worker.outbox is not None:
            worker.outbox.send(
                wire.frame("cancel", request_id=request_id, choice_index=choice_index)
            )

    def stats(self) -> EngineStats:
        ups = [w for w in self._workers if w.up]
        total = {
            f.name: sum(getattr(w.stats, f.name) for w in ups)
            for f in dataclasses.fields(EngineStats)
            if f.name != "workers"
        }
        total["waiting"] += sum(w.unreported for w in ups)
        workers = tuple(
            WorkerStats(w.rank, w.up, w.stats.running if w.up else 0,
                        (w.stats.waiting + w.unreported) if w.up else 0, w.restarts,
                        w.stats.prompt_tokens, w.stats.cached_tokens, w.routed)
            for w in self._workers
        )  # fmt: skip
        return EngineStats(**total, workers=workers)

    async def flush_cache(self) -> bool:
        loop = asyncio.get_running_loop()
        asked: list[tuple[int, asyncio.Future[bool]]] = []
        for worker in self._workers:
            if not worker.up or worker.outbox is None:
                continue
            flush_id = next(self._flush_ids)
            done: asyncio.Future[bool] = loop.create_future()
            worker.flushes[flush_id] = done
            worker.outbox.send(wire.frame("flush", id=flush_id))
            asked.append((worker.rank, done))
        results = await asyncio.gather(*(done for _, done in asked), return_exceptions=True)
        for (rank, _), flushed in zip(asked, results, strict=True):
            if flushed is True:  # its cache is empty: what it held no longer attracts prompts
                self.router.forget(rank)
        return all(r is True for r in results)

    # -------------------------------------------------------------- supervision

    async def _supervise(self, worker: _Worker, started: asyncio.Future[dict[str, Any]]) -> None:
        """Run the worker; after it exits, start it again with back-off (first start:
        a failure is the server's start-up error instead)."""
        failures = 0  # starts in a row that never got to a hello
        while True:
            worker.said_hello = False
            try:
                await self._run_once(worker, started)
            except WorkerStartError as exc:
                if not started.done():
                    started.set_exception(exc)
                    return
                log.error("engine worker failed to start", dp_rank=worker.rank, error=str(exc))
            except Exception as exc:
                log.exception("engine worker connection failed", dp_rank=worker.rank)
                if not started.done():
                    started.set_exception(WorkerStartError(str(exc)))
                    return
            if self._stopping:
                return
            # One that came up and served waits the least; failures in a row back off.
            failures = 0 if worker.said_hello else failures + 1
            delay = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
            worker.restarts += 1
            log.warning("restarting engine worker", dp_rank=worker.rank, in_s=delay)
            await asyncio.sleep(delay)

    async def _run_once(self, worker: _Worker, started: asyncio.Future[dict[str, Any]]) -> None:
        socket = self._socket_dir / f"worker{worker.rank}.sock"
        socket.unlink(missing_ok=True)
        path = str(socket)
        connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            asyncio.get_running_loop().create_future()
        )

        async def accept(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            if not connected.done():
                connected.set_result((r, w))
            else:  # one connection per worker
                w.close()

        server = await asyncio.start_unix_server(accept, path, limit=wire.MAX_FRAME)
        try:
            env = self._environment(worker.rank) if self._environment else None
            worker.proc = await asyncio.create_subprocess_exec(
                *self._command(worker.rank, path), env=env
            )
            reader, writer = await self._handshake(worker, connected)
        finally:
            server.close()
        worker.outbox = outbox = Outbox(writer)
        outbox.send(wire.frame("config", engine=self._config))
        try:
            hello = await self._read_hello(worker, reader)
            worker.stats, worker.up, worker.said_hello = EngineStats(), True, True
            worker.sent = worker.received = 0  # a new process: it counts from zero
            log.info("engine worker up", dp_rank=worker.rank, pid=hello.get("pid"))
            if not started.done():
                started.set_result(hello)
            await self._read_events(worker, reader)
        finally:
            self._worker_down(worker)
            await outbox.close()
            writer.close()
            if worker.proc.returncode is None:
                worker.proc.kill()
            await worker.proc.wait()

    async def _handshake(
        self,
        worker: _Worker,
        connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]],
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        assert worker.proc is not None
        exited = asyncio.ensure_future(worker.proc.wait())
        either: list[asyncio.Future[Any]] = [connected, exited]
        try:
            await asyncio.wait(either, timeout=START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if connected.done():
            return connected.result()
        if worker.proc.returncode is None:
            worker.proc.kill()
        await worker.proc.wait()
        raise WorkerStartError(
            f"engine worker {worker.rank} exited with {worker.proc.returncode} before it started"
        )

    async def _read_hello(self, worker: _Worker, reader: asyncio.StreamReader) -> dict[str, Any]:
        assert worker.proc is not None
        try:
            async with asyncio.timeout(START_TIMEOUT_S):  # it loads its model first
                message = await wire.read_frame(reader)
        except TimeoutError as exc:
            raise WorkerStartError(
                f"engine worker {worker.rank} did not load its model in {START_TIMEOUT_S:.0f} s"
            ) from exc
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            await worker.proc.wait()
            raise WorkerStartError(
                f"engine worker {worker.rank} exited with {worker.proc.returncode} while "
                "loading its model (its log is above)"
            ) from exc
        if message["t"] != "hello":
            raise WorkerStartError(f"engine worker {worker.rank} sent {message['t']!r} first")
        return message

    async def _read_events(self, worker: _Worker, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                message = await wire.read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if message["t"] == "events":
                events, stats = wire.events_of(message)
                worker.stats, worker.received = stats, wire.received_of(message)
                self._deliver(worker, events)
            elif message["t"] == "flushed":
                done = worker.flushes.pop(message["id"], None)
                if done is not None and not done.done():
                    done.set_result(bool(message["ok"]))

    def _deliver(self, worker: _Worker, events: list[EngineEvent]) -> None:
        """One step's events, to each request's sink in one batch, in order."""
        batches: dict[str, list[EngineEvent]] = {}
        for event in events:
            batches.setdefault(event.request_id, []).append(event)
        for request_id, batch in batches.items():
            request = worker.requests.get(request_id)
            if request is None:
                continue
            for event in batch:
                if isinstance(event, SequenceFinished):
                    request.open.pop(event.choice_index, None)
                elif isinstance(event, TokenSampled):
                    _, tokens = request.open.get(event.choice_index, (-1, 0))
                    request.open[event.choice_index] = (event.seq, tokens + 1)
                elif isinstance(event, PromptProcessed):
                    request.open[event.choice_index] = (event.seq, 0)
            if not request.open:
                del worker.requests[request_id]
                self._owner.pop(request_id, None)
            request.sink(batch)

    def _worker_down(self, worker: _Worker) -> None:
        """Its sequences can never finish: each ends with an error, at once."""
        was_up, worker.up, worker.outbox = worker.up, False, None
        self.router.forget(worker.rank)
        for done in worker.flushes.values():
            if not done.done():
                done.set_result(False)
        worker.flushes.clear()
        requests, worker.requests = worker.requests, {}
        reason = "the server is shutting down" if self._stopping else (
            f"engine worker {worker.rank} exited; its requests were lost")  # fmt: skip
        if was_up and not self._stopping:
            log.error("engine worker down", dp_rank=worker.rank, lost_requests=len(requests))
        for request_id, request in requests.items():
            self._owner.pop(request_id, None)
            request.sink([_failure(request_id, index, progress, reason)
                          for index, progress in request.open.items()])  # fmt: skip


def _failure(
    request_id: str, choice_index: int, progress: tuple[int, int], reason: str
) -> SequenceFinished:
    seq, tokens = progress
    return SequenceFinished(request_id, choice_index, seq + 1, "abort", tokens, error=reason)

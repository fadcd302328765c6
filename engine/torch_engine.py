"""The engine actor: one thread owns the model, the KV cache and the decode loop.

The event loop talks to it through an inbox (submit, cancel, flush) and receives engine
events in batches, one ``call_soon_threadsafe`` per step, so HTTP keeps being
served while torch computes and the loop is woken once per step, not per token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from sluice.events.types import EngineEvent

from .assembly import build_scheduler
from .grammar import TokenGrammar
from .interface import EngineBackend, EngineStats, EventSink
from .params import SequenceSpec
from .scheduler import SchedulerConfig

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class _Submit:
    specs: tuple[SequenceSpec, ...]
    sink: EventSink


@dataclass(frozen=True)
class _Cancel:
    request_id: str
    choice_index: int | None


@dataclass(frozen=True)
class _Flush:
    done: concurrent.futures.Future[bool]


_STOP = object()


class TorchEngine(EngineBackend):
    """``EngineBackend`` over a transformers causal LM, batching decode steps."""

    def __init__(
        self,
        model: Any,
        *,
        config: SchedulerConfig,
        eos_token_ids: frozenset[int],
        device: str = "cpu",
        threads: int | None = None,
        tokenizer: Any | None = None,
    ) -> None:
        self._threads = threads
        # Structured outputs: the tokenizer's grammar view, built once (~1 s).
        grammar = (
            TokenGrammar(tokenizer, eos_token_ids=eos_token_ids) if tokenizer is not None else None
        )
        # Shared with the front end, which compiles a request's grammar before submitting.
        self.grammar = grammar
        self._scheduler = build_scheduler(
            model,
            config,
            eos_token_ids=eos_token_ids,
            device=torch.device(device),
            grammar=grammar,
        )
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # The engine thread's last snapshot and how many submitted sequences it had
        # taken by then; ``stats`` adds those still in the inbox, so a load read right
        # after a submit (the --dp-size router's) counts them.
        self._snapshot: tuple[EngineStats, int] = (EngineStats(), 0)
        self._submitted = 0  # event-loop side only
        self.max_context = config.context_length
        # Which layers decode steps run through, and why (``/server_info``).
        self.decode_path = self._scheduler.runner.decode_path

    # ------------------------------------------------------------- event loop side

    async def start(self) -> None:
        """Start the engine thread; events are delivered on the calling event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        await asyncio.to_thread(self.stop)

    def stop(self, timeout: float = 10.0) -> None:
        """End every sequence and the engine thread (from any thread but the engine's)."""
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    def submit(self, specs: Sequence[SequenceSpec], sink: EventSink) -> None:
        self._submitted += len(specs)
        self._inbox.put(_Submit(tuple(specs), sink))

    def cancel(self, request_id: str, choice_index: int | None = None) -> None:
        self._inbox.put(_Cancel(request_id, choice_index))

    def stats(self) -> EngineStats:
        stats, taken = self._snapshot
        queued = self._submitted - taken
        return dataclasses.replace(stats, waiting=stats.waiting + queued) if queued else stats

    async def flush_cache(self) -> bool:
        done: concurrent.futures.Future[bool] = concurrent.futures.Future()
        self._inbox.put(_Flush(done))
        return await asyncio.wrap_future(done)

    # ----------------------------------------------------------------- engine side

    def _run(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)
        scheduler = self._scheduler
        pending: dict[EventSink, list[EngineEvent]] = {}
        taken = 0

        def emit(sink: EventSink, event: EngineEvent) -> None:
            pending.setdefault(sink, []).append(event)

        while True:
            # Block for work only when idle; otherwise take whatever arrived.
            block = not scheduler.has_work
            try:
                while True:
                    message = self._inbox.get(block=block)
                    block = False
                    if message is _STOP:
                        scheduler.fail_all("the server is shutting down", emit)
                        self._deliver(pending)
                        return
                    if isinstance(message, _Submit):
                        for spec in message.specs:
                            scheduler.add(spec, message.sink)
                        taken += len(message.specs)
                    elif isinstance(message, _Cancel):
                        scheduler.cancel(message.request_id, message.choice_index, emit)
                    elif isinstance(message, _Flush):
                        message.done.set_result(scheduler.flush_prefixes())
            except queue.Empty:
                pass
            if scheduler.has_work:
                try:
                    scheduler.step(emit, lambda: self._deliver(pending))
                except Exception as exc:
                    log.exception("engine step failed")
                    scheduler.fail_all(f"engine error: {exc}", emit)
            stats = EngineStats(
                running=scheduler.running,
                waiting=len(scheduler.waiting),
                steps=scheduler.steps,
                mixed_steps=scheduler.mixed_steps,
                draft_tokens=scheduler.draft_tokens,
                accepted_tokens=scheduler.accepted_tokens,
                generated_tokens=scheduler.generated_tokens,
                prompt_tokens=scheduler.prompt_tokens,
                cached_tokens=scheduler.cached_tokens,
                kv_cache_bytes=scheduler.cache.bytes_for(
                    scheduler.cache.slots, scheduler.cache.capacity
                ),
            )
            self._snapshot = (stats, taken)  # one assignment: read whole by the loop
            self._deliver(pending)

    def _deliver(self, pending: dict[EventSink, list[EngineEvent]]) -> None:
        if not pending:
            return
        batch = list(pending.items())
        pending.clear()
        assert self._loop is not None
        # RuntimeError: the loop closed under us (shutdown); nobody is listening.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(_dispatch, batch)


def _dispatch(batch: list[tuple[EventSink, list[EngineEvent]]]) -> None:
    for sink, events in batch:
        sink(events)

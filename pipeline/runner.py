"""Wiring one request through the stages.

    tokenize ─▶ engine (step batching) ─▶ detokenize ─▶ parse-fold ─▶ projection

The engine thread hands each step's events to the request over one anyio
memory-object stream, unbounded (the engine must never wait on one slow client; a
sequence produces at most ``max_tokens`` events). Detokenize and parse-fold are
synchronous folds, run on each batch in the request's own task as it pulls the next
one: a slow client slows only its own request, and a batch costs no task switches
or stream hops between stages (they were a quarter of the front end's CPU when each
stage was a task of its own). Leaving the ``events()`` block early (client gone,
error) cancels the request's sequences in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from itertools import count
from typing import Any

import anyio
import structlog
from anyio.abc import ObjectReceiveStream

from sluice.engine.grammar import ConstraintError, TokenGrammar
from sluice.engine.interface import EngineBackend
from sluice.engine.params import SequenceSpec
from sluice.events.recorder import Recording
from sluice.events.types import (
    REQUEST,
    UNNUMBERED,
    Cancelled,
    Created,
    EngineEvent,
    ErrorInfo,
    Failed,
    LifecycleEvent,
    TerminalEvent,
    terminal_of,
)

from .detokenize import DetokenizeStage
from .errors import InvalidRequest
from .job import GenerationJob
from .parse_fold import ParseFoldStage
from .token_text import TokenTexts
from .tokenize import sequence_specs, tokenize_prompts

log = structlog.get_logger(__name__)


@dataclass
class PipelineContext:
    """What the stages share across requests."""

    engine: EngineBackend
    tokenizer: Any
    texts: TokenTexts
    context_length: int
    # Output constraints compiled against the vocabulary before submission: one that
    # cannot run is refused with a 400 (None: left to the engine, which fails it alone).
    grammar: TokenGrammar | None = None


class RequestRun:
    def __init__(
        self, ctx: PipelineContext, job: GenerationJob, recording: Recording | None = None
    ) -> None:
        self.ctx = ctx
        self.job = job
        self.recording = recording
        self._seq = count()
        self._prompt_ids: list[tuple[int, ...]] = []
        self._specs: list[SequenceSpec] = []
        self._finished = False  # the engine is done with every sequence
        self._ended = False  # a terminal event left the run
        self._created: Created | None = None

    async def prepare(self) -> None:
        """The tokenize stage; raises ``InvalidRequest`` for anything wrong with the prompts
        or for an output constraint that cannot run."""
        context = self.ctx.context_length
        self._prompt_ids = await tokenize_prompts(self.ctx.tokenizer, self.job, context)
        self._specs = sequence_specs(self.job, self._prompt_ids, self.ctx.context_length)
        constraint = self.job.sampling.constraint
        if constraint is not None and self.ctx.grammar is not None:
            # The engine's own compile cache (one process) finds it compiled.
            try:
                await asyncio.wrap_future(self.ctx.grammar.prepare(constraint))
            except ConstraintError as exc:
                raise InvalidRequest(str(exc), param=self.job.names.constraint) from None

    @property
    def prompt_ids(self) -> list[tuple[int, ...]]:
        return self._prompt_ids

    @asynccontextmanager
    async def events(self) -> AsyncIterator[AsyncIterator[list[LifecycleEvent]]]:
        """The request's lifecycle events, one engine step's worth at a time.

        The engine thread's batches arrive on one unbounded stream; the detokenize and
        parse-fold stages are synchronous folds run on each batch as the consumer pulls
        it. Leaving the block before the request is done cancels its sequences.
        """
        engine_tx, engine_rx = anyio.create_memory_object_stream[Sequence[EngineEvent]](math.inf)
        recording = self.recording

        def sink(events: Sequence[EngineEvent]) -> None:
            if recording is not None:
                recording.add_engine_batch(events)
            # Closed: the request is gone and its sequences are being cancelled.
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                engine_tx.send_nowait(events)

        self.ctx.engine.submit(self._specs, sink)
        flow = self._flow(engine_rx)
        try:
            yield flow
        finally:
            if not self._finished:
                self.ctx.engine.cancel(self.job.request_id)
            engine_tx.close()
            engine_rx.close()
            await flow.aclose()

    async def pump(
        self, take: Callable[[list[LifecycleEvent]], Awaitable[None]]
    ) -> TerminalEvent | None:
        """Hand each batch of the request's events to ``take`` until the batch that ends
        the run; returns its terminal event (None: the flow ended without one). Every
        consumer (SSE, unary folds, Responses, ``/health_generate``) reads through here."""
        async with self.events() as events:
            async for batch in events:
                await take(batch)
                end = terminal_of(batch)
                if end is not None:
                    return end
        return None

    async def _flow(
        self, rx: ObjectReceiveStream[Sequence[EngineEvent]]
    ) -> AsyncGenerator[list[LifecycleEvent], None]:
        detokenize = DetokenizeStage(
            self.job,
            self._prompt_ids,
            self.ctx.tokenizer,
            self.ctx.texts,
            cancel_choice=lambda index: self.ctx.engine.cancel(self.job.request_id, index),
        )
        parse_fold = ParseFoldStage(self.job.parsing, self.job.request_id)
        if self._created is None:  # the stream begins with ``created``, then flows
            yield [self.created()]
        async for batch in rx:
            try:
                events = detokenize.feed(list(batch))
                out = parse_fold.feed(events) if events else events
            except Exception as exc:
                log.exception("pipeline stage failed", request_id=self.job.request_id)
                yield self._numbered([self._failure(exc)])
                return
            # Before the yield: a consumer may stop reading at the terminal batch.
            self._finished = detokenize.done
            if out:
                yield self._numbered(out)
            if self._finished:
                return

    def _numbered(self, events: list[LifecycleEvent]) -> list[LifecycleEvent]:
        """Events are numbered once, here, as they leave the run (strictly increasing
        from 0 whatever the stages made, dropped or failed), and recorded."""
        numbered = [replace(event, seq=next(self._seq)) for event in events]
        if self.recording is not None:
            self.recording.lifecycle_events.extend(numbered)
        self._ended = self._ended or terminal_of(numbered) is not None
        return numbered

    def created(self) -> Created:
        """The run's first event, numbered and recorded once. A background response takes
        it before it is admitted (it answers ``queued`` at once); the flow then begins
        after it."""
        if self._created is None:
            event = Created(self.job.request_id, REQUEST, UNNUMBERED, self.job.created,
                            self.job.model)  # fmt: skip
            (numbered,) = self._numbered([event])
            assert isinstance(numbered, Created)
            self._created = numbered
        return self._created

    def cancel(self, reason: str) -> Cancelled | None:
        """The run ends here, unfinished (its client went away, or it was cancelled):
        the ``Cancelled`` event, numbered and recorded like the stages' events; None
        when the run had already ended."""
        if self._ended:
            return None
        (event,) = self._numbered([Cancelled(self.job.request_id, REQUEST, UNNUMBERED, reason)])
        assert isinstance(event, Cancelled)
        return event

    def fail(self, error: ErrorInfo) -> Failed | None:
        """The run ends here with ``error`` (shutdown ran out of patience, it was never
        admitted); None when the run had already ended."""
        if self._ended:
            return None
        (event,) = self._numbered([Failed(self.job.request_id, REQUEST, UNNUMBERED, error)])
        assert isinstance(event, Failed)
        return event

    def _failure(self, exc: Exception) -> Failed:
        return Failed(
            self.job.request_id,
            REQUEST,
            UNNUMBERED,
            ErrorInfo(f"internal error: {exc}", "server_error", None, None, 500),
        )

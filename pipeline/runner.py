"""Wiring one request through the stages.

    tokenize ─▶ engine (step batching) ─▶ detokenize ─▶ parse-fold ─▶ projection

Stages are tasks joined by anyio memory-object streams that carry one engine
step's worth of events at a time. The engine → detokenize stream is unbounded
(the engine thread must never wait on one slow client; a sequence produces at most
``max_tokens`` events); the later streams are bounded, so a slow client applies
backpressure to its own request only. Leaving the ``events()`` block early (client
gone, error) cancels the request's sequences in the engine.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import count
from typing import Any

import anyio
import structlog
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from sluice.engine.interface import EngineBackend
from sluice.engine.params import SequenceSpec
from sluice.events.recorder import Recording
from sluice.events.types import (
    REQUEST,
    Created,
    EngineEvent,
    ErrorInfo,
    Failed,
    LifecycleEvent,
)

from .detokenize import DetokenizeStage
from .job import GenerationJob
from .parse_fold import ParseFoldStage
from .token_text import TokenTexts
from .tokenize import sequence_specs, tokenize_prompts

log = structlog.get_logger(__name__)

_STAGE_BUFFER = 16


@dataclass
class PipelineContext:
    """What the stages share across requests."""

    engine: EngineBackend
    tokenizer: Any
    texts: TokenTexts
    context_length: int


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
        self._finished = False

    async def prepare(self) -> None:
        """The tokenize stage; raises ``ApiError`` for anything wrong with the prompts."""
        self._prompt_ids = await tokenize_prompts(self.ctx.tokenizer, self.job)
        self._specs = sequence_specs(self.job, self._prompt_ids, self.ctx.context_length)

    @property
    def prompt_ids(self) -> list[tuple[int, ...]]:
        return self._prompt_ids

    @asynccontextmanager
    async def events(self) -> AsyncIterator[ObjectReceiveStream[list[LifecycleEvent]]]:
        engine_tx, engine_rx = anyio.create_memory_object_stream[Sequence[EngineEvent]](math.inf)
        detok_tx, detok_rx = anyio.create_memory_object_stream[list[LifecycleEvent]](_STAGE_BUFFER)
        out_tx, out_rx = anyio.create_memory_object_stream[list[LifecycleEvent]](_STAGE_BUFFER)
        recording = self.recording

        def sink(events: Sequence[EngineEvent]) -> None:
            if recording is not None:
                recording.add_engine_batch(events)
            # Closed: the request is gone and its sequences are being cancelled.
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                engine_tx.send_nowait(events)

        created = Created(
            self.job.request_id, REQUEST, next(self._seq), self.job.created, self.job.model
        )
        detok_tx.send_nowait([created])  # the stream begins with ``created``, then flows
        # Whatever the consumer raises (an API error, a dropped connection, cancellation)
        # leaves as itself, not wrapped in the task group's ExceptionGroup.
        raised: BaseException | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._detokenize, engine_rx, detok_tx)
            tg.start_soon(self._parse_fold, detok_rx, out_tx)
            self.ctx.engine.submit(self._specs, sink)
            try:
                yield out_rx
            except BaseException as exc:  # noqa: BLE001 - re-raised below, unwrapped
                raised = exc
            finally:
                if not self._finished:
                    self.ctx.engine.cancel(self.job.request_id)
                engine_tx.close()
                tg.cancel_scope.cancel()
        if raised is not None:
            raise raised

    async def _detokenize(
        self,
        rx: ObjectReceiveStream[Sequence[EngineEvent]],
        tx: ObjectSendStream[list[LifecycleEvent]],
    ) -> None:
        stage = DetokenizeStage(
            self.job,
            self._prompt_ids,
            self.ctx.tokenizer,
            self.ctx.texts,
            next_seq=lambda: next(self._seq),
            cancel_choice=lambda index: self.ctx.engine.cancel(self.job.request_id, index),
        )
        async with rx, tx:
            try:
                async for batch in rx:
                    events = stage.feed(list(batch))
                    if events:
                        await tx.send(events)
                    if stage.done:
                        self._finished = True
                        return
            except Exception as exc:
                log.exception("detokenize stage failed", request_id=self.job.request_id)
                self._finished = False
                await tx.send([self._failure(exc)])

    async def _parse_fold(
        self,
        rx: ObjectReceiveStream[list[LifecycleEvent]],
        tx: ObjectSendStream[list[LifecycleEvent]],
    ) -> None:
        stage = ParseFoldStage(self.job.parsing, self.job.request_id)
        async with rx, tx:
            try:
                async for batch in rx:
                    await tx.send(stage.feed(batch))
            except Exception as exc:
                log.exception("parse-fold stage failed", request_id=self.job.request_id)
                await tx.send([self._failure(exc)])

    def _failure(self, exc: Exception) -> Failed:
        return Failed(
            self.job.request_id,
            REQUEST,
            next(self._seq),
            ErrorInfo(f"internal error: {exc}", "server_error", None, None, 500),
        )

"""A model-free engine for in-process HTTP tests: it "generates" a fixed token cycle,
one token per step on the event loop's clock, and honours cancellation. With the
real tokenizer it drives the real routes, pipeline and projections."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.engine.interface import EngineBackend, EngineStats, EventSink
from sluice.engine.params import SequenceSpec
from sluice.events.types import PromptProcessed, SequenceFinished, TokenSampled
from sluice.http.state import ServerState
from sluice.pipeline.chat import ChatSetup
from sluice.pipeline.runner import PipelineContext
from sluice.pipeline.token_text import TokenTexts

MODEL = "fake-model"


@dataclass
class _Running:
    spec: SequenceSpec
    sink: EventSink
    emitted: int = 0
    seq: int = 0
    handle: asyncio.TimerHandle | None = None


@dataclass
class FakeEngine(EngineBackend):
    """``EngineBackend`` that emits ``tokens`` cyclically, ``step_s`` seconds per token;
    with ``stop_after_cycle`` once, ending with ``stop`` as a model's end token does."""

    tokens: Sequence[int]
    step_s: float = 0.001
    stop_after_cycle: bool = False
    max_context: int = 8192
    running: dict[tuple[str, int], _Running] = field(default_factory=dict)
    submitted: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cancelled: list[tuple[str, int | None]] = field(default_factory=list)
    routing_keys: list[str | None] = field(default_factory=list)  # one per sequence

    def submit(self, specs: Sequence[SequenceSpec], sink: EventSink) -> None:
        loop = asyncio.get_running_loop()
        for spec in specs:
            self.submitted += 1
            self.routing_keys.append(spec.routing_key)
            self.prompt_tokens += len(spec.prompt_ids)
            run = _Running(spec, sink)
            self.running[spec.key] = run
            sink([PromptProcessed(spec.request_id, spec.choice_index, 0, len(spec.prompt_ids), 0)])
            run.seq = 1
            run.handle = loop.call_later(self.step_s, self._step, run)

    def _step(self, run: _Running) -> None:
        spec = run.spec
        token = self.tokens[run.emitted % len(self.tokens)]
        run.emitted += 1
        self.generated_tokens += 1
        events: list[Any] = [TokenSampled(spec.request_id, spec.choice_index, run.seq, token)]
        run.seq += 1
        stop = self.stop_after_cycle and run.emitted == len(self.tokens)
        if stop or run.emitted >= spec.sampling.max_tokens:
            reason = "stop" if stop else "length"
            events.append(
                SequenceFinished(spec.request_id, spec.choice_index, run.seq, reason, run.emitted)
            )
            self.running.pop(spec.key, None)
        else:
            run.handle = asyncio.get_running_loop().call_later(self.step_s, self._step, run)
        run.sink(events)

    def cancel(self, request_id: str, choice_index: int | None = None) -> None:
        self.cancelled.append((request_id, choice_index))
        for key, run in list(self.running.items()):
            if key[0] == request_id and choice_index in (None, key[1]):
                if run.handle is not None:
                    run.handle.cancel()
                del self.running[key]
                run.sink([SequenceFinished(request_id, key[1], run.seq, "abort", run.emitted)])

    async def flush_cache(self) -> bool:
        """Refused while anything runs, as the real engine's is."""
        return not self.running

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.running),
            generated_tokens=self.generated_tokens,
            prompt_tokens=self.prompt_tokens,
        )


def fake_state(tokenizer: Any, engine: FakeEngine) -> ServerState:
    """A server state over the fake engine and the real tokenizer and chat template."""
    pipeline = PipelineContext(engine, tokenizer, TokenTexts(tokenizer), engine.max_context)
    return ServerState(pipeline, MODEL, chat=ChatSetup.for_tokenizer(None, tokenizer))


class FailingEngine(FakeEngine):
    """Every sequence ends in an engine error at its first step."""

    def _step(self, run: Any) -> None:
        spec = run.spec
        self.running.pop(spec.key, None)
        end = SequenceFinished(
            spec.request_id, spec.choice_index, run.seq, "abort", 0, error="boom"
        )
        run.sink([end])

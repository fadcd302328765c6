"""The step scheduler: admits sequences, plans each forward, updates from its logits.

One call of ``step()`` is one engine step, in three phases:

1. **plan** (``schedule``): admit waiting sequences into free cache slots (reusing
   the longest cached prompt prefix found in a running or recently finished slot),
   take this step's prompt chunks (at most ``prefill_chunk`` prompt tokens in all)
   and each decoding row's draft, and return a ``StepPlan``: with ``mixed_chunk``
   (where the runner ``packs``) one packed forward over the decode runs and the
   chunks; otherwise a prefill forward, and after it a decode forward that the
   finished prompts join (their first tokens handed out between, by ``flush``);
2. **execute**: the runner (``plan.StepRunner``; ``model_runner`` over a model) runs
   the plan and samples every position it scores on the device (``step_sampler``);
3. **update**: take the sampled tokens in order, verify drafts, advance grammars,
   apply ``finish.finish_after``, emit the events and retire finished sequences.

With ``speculative`` (``--speculative-algorithm NGRAM``) a decoding row whose end
matches earlier tokens carries a draft (``speculative``): its last token and the draft
run as one packed run, each position is sampled as a plain step would sample it after
the draft before it, and the draft is kept up to the first position where the sampled
token differs; the KV
written for the rest is beyond the row's length, overwritten before it is read.

The engine's assembly (``assembly``) builds the cache, the runner and its capture and
hands them in; the slot table (``slots``) says where each sequence's KV lives and
which prefixes free slots keep. This class decides what runs, and what it meant.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import Generic, TypeVar

import structlog
import torch

from sluice.events.types import (
    EngineEvent,
    EngineFinishReason,
    PromptProcessed,
    SequenceFinished,
    TokenSampled,
)

from .finish import Finish
from .grammar import ConstraintError, TokenGrammar
from .interface import EventSink
from .kv_cache import SlotKVCache
from .params import SequenceSpec
from .plan import DecodeRun, ForwardKind, PromptChunk, Sampled, StepPlan, StepRunner, StepSamples
from .sampler import RowState
from .sequence import Sequence
from .slots import SlotTable
from .speculative import NgramDrafter, SpeculativeConfig, verify
from .step_sampler import rewind

log = structlog.get_logger(__name__)

_SHARED_RNG = random.Random()


@dataclass
class SchedulerConfig:
    max_running: int
    context_length: int
    prefill_chunk: int = 512
    free_slots_kept: int = 16
    kv_cache_bytes: int = 4 << 30
    initial_capacity: int = 256
    # Decode at fixed shapes (``cuda_graphs``), captured as CUDA graphs on a CUDA
    # device (compiled by inductor where ``compile_decode``), for batches of up to
    # ``graph_max_batch`` rows (0: ``max_running``).
    fixed_shape_decode: bool = False
    graph_max_batch: int = 0
    compile_decode: bool = False
    # Steps that prefill while others decode run both in one packed forward
    # (``packed``); otherwise a prefill forward, then a decode forward.
    mixed_chunk: bool = True
    # N-gram speculative decoding (``speculative``); None: one token per row a step.
    speculative: SpeculativeConfig | None = None


Emit = Callable[[EventSink, EngineEvent], None]
RunnerT = TypeVar("RunnerT", bound=StepRunner)


class StepScheduler(Generic[RunnerT]):
    def __init__(
        self,
        runner: RunnerT,
        cache: SlotKVCache,
        config: SchedulerConfig,
        *,
        eos_token_ids: frozenset[int],
        grammar: TokenGrammar | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.runner = runner
        # Token ids past it would fail the step of every row batched with theirs: such
        # a sequence is refused at admission.
        self.vocab_size = vocab_size
        self.cache = cache
        # Constrained sequences (``SamplingParams.constraint``) need it; without one
        # they fail with a clear error. ``constrained`` counts them while they run, so
        # a step with none never looks for a grammar.
        self.grammar = grammar
        self.constrained = 0
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.table = SlotTable(cache)
        self.steps = 0
        self.mixed_steps = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    # ------------------------------------------------------------------ requests

    @property
    def running(self) -> int:
        return self.table.running

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self.running > 0

    def add(self, spec: SequenceSpec, sink: EventSink) -> None:
        p = spec.sampling
        # Seeded: one generator per choice, so n choices of one seed differ but repeat.
        rng = random.Random(f"{p.seed}:{spec.choice_index}") if p.seed is not None else _SHARED_RNG
        stop_ids = p.stop_token_ids | (frozenset() if p.ignore_eos else self.eos_token_ids)
        row = RowState(params=p, rng=rng, prompt=spec.prompt_ids, stop_ids=stop_ids)
        seq = Sequence(spec=spec, sink=sink, row=row)
        seq.refusal = spec.token_id_problem(self.vocab_size)
        if self.config.speculative is not None:
            seq.drafter = NgramDrafter(self.config.speculative, spec.prompt_ids)
        if p.constraint is not None and self.grammar is not None:
            seq.grammar_ready = self.grammar.prepare(p.constraint)
        self.waiting.append(seq)

    def cancel(self, request_id: str, choice_index: int | None, emit: Emit) -> None:
        def matches(seq: Sequence) -> bool:
            return seq.spec.request_id == request_id and (
                choice_index is None or seq.spec.choice_index == choice_index
            )

        kept: deque[Sequence] = deque()
        for seq in self.waiting:
            if matches(seq):
                self._finish_event(seq, "abort", None, emit)
            else:
                kept.append(seq)
        self.waiting = kept
        for running in self.table.in_use():
            if matches(running):
                running.cancelled = True

    def flush_prefixes(self) -> bool:
        """Forget the prefixes kept in free slots; only when idle (False otherwise)."""
        if self.has_work:
            return False
        self.table.forget_prefixes()
        return True

    def fail_all(self, message: str, emit: Emit) -> None:
        """After an engine error: end every sequence with the error, start clean."""
        for seq in [*self.table.in_use(), *self.waiting]:
            self._finish_event(seq, "abort", None, emit, error=message)
        self.waiting.clear()
        self.table.clear()
        self.constrained = 0

    # ---------------------------------------------------------------------- step

    @torch.inference_mode()
    def step(self, emit: Emit, flush: Callable[[], None] | None = None) -> None:
        """One engine step; ``flush`` (if given) is called between a prefill forward and
        the decode forward after it, so that first tokens go out without waiting."""
        plan = self.schedule(emit)
        if plan is None:
            return
        self.update(plan, self.runner.execute(plan), emit)
        if plan.kind is ForwardKind.PREFILL and self.table.decoding:
            if flush is not None:
                flush()
            decode = self._plan_decode()
            self.update(decode, self.runner.execute(decode), emit)

    def schedule(self, emit: Emit) -> StepPlan | None:
        """Retire cancelled sequences, admit waiting ones, and plan this step's first
        forward (None: nothing runs)."""
        self.steps += 1
        self._retire_cancelled(emit)
        self._admit(emit)
        table = self.table
        if table.prefilling and table.decoding and self.config.mixed_chunk and self.runner.packs:
            self.mixed_steps += 1
            return StepPlan(
                ForwardKind.MIXED,
                decode=self._plan_decode().decode,
                chunks=self._plan_chunks(),
                chunk_slot=table.decoding,
                grammar=self._grammar_in_use,
            )
        if table.prefilling:
            return StepPlan(
                ForwardKind.PREFILL,
                chunks=self._plan_chunks(),
                chunk_slot=table.decoding,
                grammar=self._grammar_in_use,
            )
        if table.decoding:
            return self._plan_decode()
        return None

    def update(self, plan: StepPlan, samples: StepSamples, emit: Emit) -> None:
        """Act on an executed plan: take its samples, verify drafts, emit, promote and
        retire."""
        # Every row's KV length is settled before anything moves slots (swaps copy
        # kv_len): the decode runs' by verifying, the chunks' in ``_finish_chunks``;
        # the decode rows that finished retire after both.
        finished: list[tuple[Sequence, Finish]] = []
        if plan.decode:
            finished = self._verify(samples, plan.decode, emit)
        if plan.chunks:
            self._finish_chunks(plan.chunks, samples, emit)
        self._retire_finished(finished, emit)

    @property
    def _grammar_in_use(self) -> TokenGrammar | None:
        return self.grammar if self.constrained else None

    def _retire_cancelled(self, emit: Emit) -> None:
        for seq in self.table.in_use():
            if seq.cancelled:
                self._retire(seq, "abort", None, emit)

    # ----------------------------------------------------------------- admission

    def _need_len(self, seq: Sequence) -> int:
        return min(len(seq.prompt) + seq.row.params.max_tokens, self.config.context_length)

    def _admit(self, emit: Emit) -> None:
        compiling: list[Sequence] = []  # passed over, in order, until their grammar is ready
        while self.waiting and self.running < self.config.max_running:
            seq = self.waiting[0]
            if seq.refusal is not None:
                self.waiting.popleft()
                self._finish_event(seq, "abort", None, emit, error=seq.refusal)
                continue
            if seq.grammar_ready is not None and not seq.grammar_ready.done():
                compiling.append(self.waiting.popleft())
                continue
            if not self._make_room(seq):
                if self.running == 0:
                    self.waiting.popleft()
                    self._finish_event(
                        seq,
                        "abort",
                        None,
                        emit,
                        error="the KV cache cannot hold this sequence "
                        "(raise --kv-cache-gb or lower max_tokens)",
                    )
                    continue
                break
            self.waiting.popleft()
            if seq.row.params.constraint is not None and not self._start_grammar(seq, emit):
                continue
            self.table.place(seq)
        self.waiting.extendleft(reversed(compiling))
        if compiling and self.running == 0:
            # Nothing else to step: wait for a compile rather than spin.
            futures = [s.grammar_ready for s in compiling if s.grammar_ready is not None]
            wait(futures, timeout=0.05, return_when=FIRST_COMPLETED)

    def _start_grammar(self, seq: Sequence, emit: Emit) -> bool:
        """Give ``seq`` its matcher; False (and the sequence finished) if it cannot."""
        constraint = seq.row.params.constraint
        assert constraint is not None
        error = None
        if self.grammar is None:
            error = "constrained generation needs the engine's tokenizer grammar"
        else:
            try:
                if seq.grammar_ready is not None:
                    seq.grammar_ready.result()  # raises the compile's error
                seq.row.matcher = self.grammar.matcher(constraint)
            except ConstraintError as exc:
                error = str(exc)
        if error is not None:
            self._finish_event(seq, "abort", None, emit, error=error)
            return False
        self.constrained += 1
        return True

    def _make_room(self, seq: Sequence) -> bool:
        """Grow the cache so ``seq`` fits beside the running sequences; False if over
        the byte budget."""
        config = self.config
        return self.table.make_room(
            max(self._need_len(s) for s in [*self.table.in_use(), seq]),
            context_length=config.context_length,
            slot_limit=config.max_running + config.free_slots_kept,
            budget=config.kv_cache_bytes,
        )

    # ------------------------------------------------------------------ planning

    def _plan_chunks(self) -> tuple[PromptChunk, ...]:
        """The prompt chunks of this step, in slot order, within the token budget."""
        budget = self.config.prefill_chunk
        chunks: list[PromptChunk] = []
        for seq in self.table.prefill_rows():
            if budget <= 0:
                break
            start = seq.kv_len
            n = min(len(seq.prompt) - start, budget)
            # Position t predicts prompt token t + 1; the chunk's last position predicts
            # the next chunk's first token (or, at the end of the prompt, nothing).
            scored = 0
            if seq.row.params.prompt_logprobs is not None:
                scored = min(n, len(seq.prompt) - start - 1)
            chunks.append(
                PromptChunk(
                    seq,
                    start,
                    seq.prompt[start : start + n],
                    completes=start + n == len(seq.prompt),
                    scored=scored,
                )
            )
            budget -= n
        return tuple(chunks)

    def _plan_decode(self) -> StepPlan:
        return StepPlan(
            ForwardKind.DECODE,
            decode=tuple(
                DecodeRun(
                    seq,
                    seq.kv_len,
                    (seq.generated[-1], *seq.draft(self.config.context_length)),
                )
                for seq in self.table.decode_rows()
            ),
            grammar=self._grammar_in_use,
        )

    # ------------------------------------------------------------------- updates

    def _finish_chunks(
        self, chunks: tuple[PromptChunk, ...], samples: StepSamples, emit: Emit
    ) -> None:
        """After a forward over ``chunks``: prompt logprobs, and each finished prompt's
        first token."""
        finished_prompt: list[tuple[Sequence, Sampled | None]] = []
        for chunk, scored, first in zip(
            chunks, samples.prompt_logprobs, samples.first, strict=True
        ):
            seq = chunk.seq
            if seq.row.params.prompt_logprobs is not None:
                if chunk.start == 0:
                    seq.prompt_lps.append(None)
                if scored is not None:
                    seq.prompt_lps.extend(scored)
            seq.kv_len += len(chunk.tokens)
            if chunk.completes:
                finished_prompt.append((seq, first))
        first_tokens: list[tuple[Sequence, Sampled]] = []
        for seq, first in finished_prompt:
            self.prompt_tokens += len(seq.prompt)
            self.cached_tokens += seq.cached_tokens
            emit(
                seq.sink,
                PromptProcessed(
                    seq.spec.request_id,
                    seq.spec.choice_index,
                    seq.next_seq(),
                    prompt_tokens=len(seq.prompt),
                    cached_tokens=seq.cached_tokens,
                    prompt_logprobs=tuple(seq.prompt_lps)
                    if seq.row.params.prompt_logprobs is not None
                    else None,
                ),
            )
            self.table.promote(seq)
            if first is None:  # ``echo`` scoring only: nothing to generate
                self._retire(seq, "length", None, emit)
            else:
                first_tokens.append((seq, first))
        if first_tokens:
            seqs, firsts = zip(*first_tokens, strict=True)
            self._retire_finished(self._take(list(seqs), list(firsts), emit)[1], emit)

    def _verify(
        self, samples: StepSamples, runs: tuple[DecodeRun, ...], emit: Emit
    ) -> list[tuple[Sequence, Finish]]:
        """Take the decode runs' samples (one per run position: each run's last token,
        then its draft) as far as ``speculative.verify`` keeps them. Sets each row's KV
        length to what it kept; returns the rows that finished, for the caller to
        retire."""
        rows = [run.seq for run in runs]
        finished: list[tuple[Sequence, Finish]] = []

        def take_at(active: list[int], at: list[int]) -> list[int | None]:
            sampled = [samples.decode[a] for a in at]
            tokens, ended = self._take([rows[i] for i in active], sampled, emit)
            finished.extend(ended)
            done = {seq for seq, _ in ended}
            return [None if rows[i] in done else t for i, t in zip(active, tokens, strict=True)]

        drafts = [run.draft for run in runs]
        kept = verify(drafts, take_at)
        for seq, draft, n, before in zip(rows, drafts, kept, samples.rng_before, strict=True):
            seq.kv_len += 1 + n
            if before is not None and n < len(draft):
                rewind(seq.row.rng, before, 1 + n)
            if seq.drafter is not None:
                seq.drafter.settle(len(draft), n)
        self.draft_tokens += sum(len(draft) for draft in drafts)
        self.accepted_tokens += sum(kept)
        return finished

    # ------------------------------------------------------------------ sampling

    def _take(
        self, rows: list[Sequence], sampled: list[Sampled], emit: Emit
    ) -> tuple[list[int], list[tuple[Sequence, Finish]]]:
        """One sampled token per row: taken by its sequence and emitted; a row whose
        sampling failed takes nothing and finishes with the error. Returns the tokens and
        the rows that finished (not yet retired)."""
        finished: list[tuple[Sequence, Finish]] = []
        for seq, chosen in zip(rows, sampled, strict=True):
            if chosen.error is not None:
                finished.append((seq, Finish("abort", error=chosen.error)))
                continue
            spec = seq.spec
            finish = seq.take(chosen.token, context_length=self.config.context_length)
            self.generated_tokens += 1
            emit(
                seq.sink,
                TokenSampled(
                    spec.request_id, spec.choice_index, seq.next_seq(), chosen.token, chosen.logprob
                ),
            )
            if finish is not None:
                finished.append((seq, finish))
        return [s.token for s in sampled], finished

    def _retire_finished(self, finished: list[tuple[Sequence, Finish]], emit: Emit) -> None:
        for seq, finish in finished:
            self._retire(seq, finish.reason, finish.matched_token, emit, error=finish.error)

    # ------------------------------------------------------------------ retiring

    def _retire(
        self,
        seq: Sequence,
        reason: EngineFinishReason,
        matched: int | None,
        emit: Emit,
        *,
        error: str | None = None,
    ) -> None:
        if seq.row.matcher is not None:
            seq.row.matcher = None
            self.constrained -= 1
        self.table.release(seq)
        self._finish_event(seq, reason, matched, emit, error=error)

    def _finish_event(
        self,
        seq: Sequence,
        reason: EngineFinishReason,
        matched: int | None,
        emit: Emit,
        *,
        error: str | None = None,
    ) -> None:
        emit(
            seq.sink,
            SequenceFinished(
                seq.spec.request_id,
                seq.spec.choice_index,
                seq.next_seq(),
                reason=reason,
                completion_tokens=len(seq.generated),
                matched_token=matched,
                error=error,
            ),
        )

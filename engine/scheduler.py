"""The step scheduler: admits sequences, runs batched forwards, samples, retires.

One call of ``step()`` is one engine step:

1. admit waiting sequences into free cache slots (reusing the longest cached prompt
   prefix found in a running or recently finished slot),
2. take this step's prompt chunks, at most ``prefill_chunk`` prompt tokens in all,
3. run the forward: with ``mixed_chunk`` (where ``runner.packs``) one packed forward
   over the decoding rows' last tokens and the chunks (``model_runner.forward_packed``);
   otherwise a prefill forward, the finished prompts' first tokens handed out
   (``flush``), then one decode forward that they join,
4. sample per row (``sampler.sample``), emit token events, retire finished sequences.

With ``speculative`` (``--speculative-algorithm NGRAM``) a decoding row whose end
matches earlier tokens carries a draft (``speculative``): its last token and the draft
run as one packed run, each position is sampled as a plain step would sample it, and
the draft is kept up to the first position where the sampled token differs; the KV
written for the rest is beyond the row's length, overwritten before it is read.

The model runner (``model_runner``) executes forwards, ``finish.finish_after``
decides when a sequence ends, and the slot table (``slots``) where each sequence's KV
lives and which prefixes free slots keep; this class decides what runs.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from sluice.events.types import (
    EngineEvent,
    EngineFinishReason,
    PromptProcessed,
    SequenceFinished,
    TokenSampled,
)

from .attention import UnsupportedModelError
from .cuda_graphs import StaticDecode
from .finish import Finish, GrammarVerdict, finish_after
from .grammar import ConstraintError, TokenGrammar
from .interface import EventSink
from .kv_cache import SlotKVCache
from .model_runner import ModelRunner, TokenRun
from .params import SequenceSpec
from .sampler import RowState, prompt_logprobs, sample
from .sequence import Sequence
from .slots import SlotTable
from .speculative import NgramDrafter, SpeculativeConfig

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
    # device, for batches of up to ``graph_max_batch`` rows (0: ``max_running``).
    fixed_shape_decode: bool = False
    graph_max_batch: int = 0
    # Steps that prefill while others decode run both in one packed forward
    # (``packed``); otherwise a prefill forward, then a decode forward.
    mixed_chunk: bool = True
    # N-gram speculative decoding (``speculative``); None: one token per row a step.
    speculative: SpeculativeConfig | None = None


Emit = Callable[[EventSink, EngineEvent], None]


class StepScheduler:
    def __init__(
        self,
        model: Any,
        config: SchedulerConfig,
        *,
        eos_token_ids: frozenset[int],
        device: torch.device,
        grammar: TokenGrammar | None = None,
    ) -> None:
        self.model = model
        # Constrained sequences (``SamplingParams.constraint``) need it; without one
        # they fail with a clear error. ``constrained`` counts them while they run, so
        # a step with none never looks for a grammar.
        self.grammar = grammar
        self.constrained = 0
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.device = device
        mc = model.config
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        self.cache = SlotKVCache(
            layers=mc.num_hidden_layers,
            kv_heads=getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads,
            head_dim=head_dim,
            dtype=next(model.parameters()).dtype,
            device=device,
            slots=1,
            capacity=min(config.initial_capacity, config.context_length),
        )
        # Start with a few slots, as many as the byte budget allows (at least one).
        affordable = config.kv_cache_bytes // self.cache.bytes_for(1, self.cache.capacity)
        start = min(8, config.max_running + config.free_slots_kept, affordable)
        self.cache.resize(max(1, start), self.cache.capacity)
        self.runner = ModelRunner(model, self.cache, context_length=config.context_length)
        self.runner.self_check()
        if config.speculative is not None and not self.runner.packs:
            raise UnsupportedModelError(
                f"{type(model).__name__}: speculative decoding verifies drafts in packed "
                "forwards, which need SDPA or the model's own eager attention"
            )
        self.static_decode = (
            StaticDecode(
                self.runner,
                max_batch=config.graph_max_batch or config.max_running,
                capture=device.type == "cuda",
            )
            if config.fixed_shape_decode
            else None
        )
        self.waiting: deque[Sequence] = deque()
        self.table = SlotTable(self.cache)
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
        """One engine step; ``flush`` (if given) is called between the prefill and the
        decode forward, so that first tokens go out without waiting a decode step."""
        self.steps += 1
        self._retire_cancelled(emit)
        self._admit(emit)
        table = self.table
        if table.prefilling and table.decoding and self.config.mixed_chunk and self.runner.packs:
            self._mixed(emit)
            return
        if table.prefilling:
            self._prefill(emit)
            if flush is not None and table.decoding:
                flush()
        if table.decoding:
            self._decode(emit)

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

    # ------------------------------------------------------------------ forwards

    def _plan_chunks(self) -> list[tuple[Sequence, int]]:
        """The prompt chunks of this step, in slot order, within the token budget."""
        budget = self.config.prefill_chunk
        chunks: list[tuple[Sequence, int]] = []
        for seq in self.table.prefill_rows():
            if budget <= 0:
                break
            n = min(len(seq.prompt) - seq.kv_len, budget)
            chunks.append((seq, n))
            budget -= n
        return chunks

    def _mixed(self, emit: Emit) -> None:
        """Decode rows and prompt chunks in one packed forward (``packed``)."""
        self.mixed_steps += 1
        rows = self.table.decode_rows()
        drafts = [self._draft(seq) for seq in rows]
        chunks = self._plan_chunks()
        decode_hidden, chunk_hidden = self.runner.forward_packed(
            [
                (0, self._decode_runs(rows, drafts)),
                (
                    self.table.decoding,
                    [
                        TokenRun(seq.kv_len, seq.prompt[seq.kv_len : seq.kv_len + n])
                        for seq, n in chunks
                    ],
                ),
            ]
        )
        # Every row's KV length is settled before anything moves slots (swaps copy
        # kv_len): the decode rows' by verifying, the chunks' in ``_finish_chunks``;
        # the decode rows that finished retire after both.
        finished = self._verify(decode_hidden, rows, drafts, emit)
        self._finish_chunks(chunks, chunk_hidden, emit)
        self._retire_finished(finished, emit)

    def _prefill(self, emit: Emit) -> None:
        start = self.table.decoding
        chunks = self._plan_chunks()
        width = max(n for _, n in chunks)
        ids = torch.zeros(len(chunks), width, dtype=torch.long)
        positions = torch.zeros(len(chunks), width, dtype=torch.long)
        for r, (seq, n) in enumerate(chunks):
            ids[r, :n] = torch.tensor(seq.prompt[seq.kv_len : seq.kv_len + n])
            # Padding continues the positions; its KV lands beyond the sequence's valid
            # length and is overwritten before anything reads it.
            positions[r] = torch.arange(seq.kv_len, seq.kv_len + width)
        hidden = self.runner.forward(
            slice(start, start + len(chunks)), ids.to(self.device), positions.to(self.device)
        )
        self._finish_chunks(chunks, hidden, emit)

    def _finish_chunks(
        self, chunks: list[tuple[Sequence, int]], hidden: torch.Tensor, emit: Emit
    ) -> None:
        """After a forward over ``chunks`` (hidden states ``[chunks, width, H]``): prompt
        logprobs, and each finished prompt's first token."""
        finished_prompt: list[Sequence] = []
        last_hidden: list[torch.Tensor] = []
        for r, (seq, n) in enumerate(chunks):
            k = seq.row.params.prompt_logprobs
            if k is not None:
                self._collect_prompt_logprobs(seq, hidden[r, :n], n, k)
            seq.kv_len += n
            if seq.kv_len == len(seq.prompt):
                finished_prompt.append(seq)
                last_hidden.append(hidden[r, n - 1])
        if not finished_prompt:
            return
        logits = self.runner.head(torch.stack(last_hidden)).float().cpu()
        to_sample: list[Sequence] = []
        for seq in finished_prompt:
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
            if seq.row.params.max_tokens == 0:  # ``echo`` scoring only: nothing to generate
                self._retire(seq, "length", None, emit)
            else:
                to_sample.append(seq)
        if to_sample:
            keep = [i for i, seq in enumerate(finished_prompt) if seq in to_sample]
            self._sample_and_emit(logits[keep], to_sample, emit)

    def _collect_prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, n: int, k: int) -> None:
        begin = seq.kv_len
        if begin == 0:
            seq.prompt_lps.append(None)
        # Position t predicts prompt token t + 1; the chunk's last position predicts
        # the next chunk's first token (or, at the end of the prompt, nothing).
        targets = seq.prompt[begin + 1 : begin + n + 1]
        if not targets:
            return
        logits = self.runner.head(hidden[: len(targets)]).float().cpu()
        seq.prompt_lps.extend(prompt_logprobs(logits, targets, k))

    def _decode(self, emit: Emit) -> None:
        rows = self.table.decode_rows()
        count = len(rows)
        if self.config.speculative is not None:
            drafts = [self._draft(seq) for seq in rows]
            if any(drafts):
                (hidden,) = self.runner.forward_packed([(0, self._decode_runs(rows, drafts))])
                self._retire_finished(self._verify(hidden, rows, drafts, emit), emit)
                return
        last = [seq.generated[-1] for seq in rows]
        at = [seq.kv_len for seq in rows]
        logits = None
        if self.static_decode is not None:
            logits = self.static_decode.run(last, at)
        if logits is None:
            ids = torch.tensor(last, dtype=torch.long).unsqueeze(1)
            positions = torch.tensor(at, dtype=torch.long).unsqueeze(1)
            hidden = self.runner.forward(
                slice(0, count), ids.to(self.device), positions.to(self.device)
            )
            logits = self.runner.head(hidden[:, -1])
        for seq in rows:
            seq.kv_len += 1
        self._sample_and_emit(logits.float().cpu(), rows, emit)

    # ---------------------------------------------------------------- speculation

    def _draft(self, seq: Sequence) -> list[int]:
        """The tokens ``seq`` is expected to go on with (none without speculation), no
        more than it may still generate or its context still holds."""
        if seq.drafter is None:
            return []
        seq.drafter.sync(seq.generated)
        room = min(
            seq.row.params.max_tokens - len(seq.generated) - 1,
            self.config.context_length - 1 - seq.kv_len,
        )
        return seq.drafter.propose(room)

    @staticmethod
    def _decode_runs(rows: list[Sequence], drafts: list[list[int]]) -> list[TokenRun]:
        return [
            TokenRun(seq.kv_len, [seq.generated[-1], *draft])
            for seq, draft in zip(rows, drafts, strict=True)
        ]

    def _verify(
        self,
        hidden: torch.Tensor,
        rows: list[Sequence],
        drafts: list[list[int]],
        emit: Emit,
    ) -> list[tuple[Sequence, Finish]]:
        """Sample the decode rows from ``hidden`` (``[rows, W, H]``: each row's last token,
        then its draft), position by position; a row goes on to the next position while
        the token sampled at this one is its draft's. Sets each row's KV length to what
        it kept; returns the rows that finished, for the caller to retire."""
        lengths = [1 + len(draft) for draft in drafts]
        valid = torch.arange(hidden.shape[1]).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
        logits = self.runner.head(hidden[valid.to(hidden.device)]).float().cpu()
        offsets = [0]
        for n in lengths[:-1]:
            offsets.append(offsets[-1] + n)
        kept = [0] * len(rows)
        finished: list[tuple[Sequence, Finish]] = []
        active = list(range(len(rows)))
        for position in range(max(lengths)):
            at = [offsets[i] + position for i in active]
            tokens, ended = self._sample(logits[at], [rows[i] for i in active], emit)
            finished.extend(ended)
            done = {seq for seq, _ in ended}
            active = [
                i
                for i, token in zip(active, tokens, strict=True)
                if rows[i] not in done
                and position < len(drafts[i])
                and token == drafts[i][position]
            ]
            if not active:
                break
            for i in active:
                kept[i] += 1
        for seq, draft, n in zip(rows, drafts, kept, strict=True):
            seq.kv_len += 1 + n
            if seq.drafter is not None:
                seq.drafter.settle(len(draft), n)
        self.draft_tokens += sum(lengths) - len(rows)
        self.accepted_tokens += sum(kept)
        return finished

    # ------------------------------------------------------------------ sampling

    def _sample_and_emit(self, logits: torch.Tensor, rows: list[Sequence], emit: Emit) -> None:
        self._retire_finished(self._sample(logits, rows, emit)[1], emit)

    def _sample(
        self, logits: torch.Tensor, rows: list[Sequence], emit: Emit
    ) -> tuple[list[int], list[tuple[Sequence, Finish]]]:
        """One token per row of ``logits``: sampled, emitted, and passed through the
        finish policy. Returns the tokens and the rows that finished (not yet retired)."""
        grammar = self.grammar if self.constrained else None
        result = sample(logits, [seq.row for seq in rows], grammar)
        finished: list[tuple[Sequence, Finish]] = []
        for seq, token, logprob in zip(rows, result.tokens, result.logprobs, strict=True):
            seq.generated.append(token)
            self.generated_tokens += 1
            emit(
                seq.sink,
                TokenSampled(
                    seq.spec.request_id, seq.spec.choice_index, seq.next_seq(), token, logprob
                ),
            )
            matcher = seq.row.matcher
            verdict = None
            if matcher is not None:
                accepted = matcher.consume(token)
                verdict = GrammarVerdict(accepted, matcher.stopped, matcher.error)
            finish = finish_after(
                token,
                generated=len(seq.generated),
                params=seq.row.params,
                stop_ids=seq.row.stop_ids,
                prompt_len=len(seq.prompt),
                context_length=self.config.context_length,
                grammar=verdict,
            )
            if finish is not None:
                finished.append((seq, finish))
        return result.tokens, finished

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

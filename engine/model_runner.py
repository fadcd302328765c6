"""Executes forwards over the slot cache: the decoder, each layer's mask, the LM head.

The scheduler decides which rows run and at which positions; the runner turns that
into one decoder call and the logits of the rows asked for. It calls the decoder and
the LM head separately (a prefill chunk needs logits at one position per row, not
the whole vocabulary at every position), so the logit post-processing that the
model's ``…ForCausalLM.forward`` applies after its LM head is applied here too:
Gemma's final soft-cap, Granite's ``logits_scaling``, Cohere's ``logit_scale``.

``execute`` runs a scheduler's ``StepPlan`` and samples it on the device its logits
are on (``step_sampler``), returning the tokens and logprobs. Under it, ``forward``
runs rows of one kind (padded prompt chunks, or one token per decoding row);
``forward_packed`` packs a step's decode rows (with their speculative drafts) and
prompt chunks into one forward (``packed``), for models on SDPA or on eager attention
their code defines (``packs``), and through ``direct`` where its groups are short; a
plain decode runs at a fixed shape where ``static``
(``cuda_graphs``) is set and fits, else through ``direct`` (``direct_decode``: the
layers without transformers' modules) where the assembly chose it. A model whose
layers carry a recurrent state (``recurrent_state``) prefills one chunk a forward,
unpadded, and never packs.

Before serving, ``self_check`` runs a prompt through this path and through the
model's own forward, then (unquantised) one decode step of two rows at different
positions against each row stepping alone: a model whose logits this path does not
reproduce (a layer kind, a cache call, a position taken from the batch, or a
post-processing step not handled here) is refused at start-up with its architecture
named, instead of being served wrong tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import packed
from .attention import AttentionLayout
from .errors import UnsupportedModelError
from .fused_projections import quantization_of
from .kv_cache import SlotKVCache
from .plan import ForwardKind, StepLogits, StepPlan, StepSamples
from .step_sampler import sample_plan

if TYPE_CHECKING:
    from .cuda_graphs import StaticDecode
    from .direct_decode import DecodePath, DirectDecode

_PROBE_TOKENS = 16
# How far the probe's log-probabilities may stray from the model's own forward: two
# different SDPA kernels agree to ~1e-5 in fp32 and to a few hundredths in 16 bits. In
# bfloat16 the logits themselves are 0.25 apart from 32 up, so a last-bit difference
# upstream moves one by a whole step: SmolLM2 unquantised on an Intel Xeon with AMX
# gave 0.317 between a row alone and the same row beside another.
_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.5, torch.float16: 0.1}
_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


class LogitsHead:
    """The LM head and the post-processing of its output, as the model's forward does it
    (a packed head's float32 output is not rounded to the activations' dtype first)."""

    def __init__(self, model: Any) -> None:
        config = model.config
        self.lm_head = model.get_output_embeddings()
        self.multiply = getattr(config, "logit_scale", None)
        self.divide = getattr(config, "logits_scaling", None)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        # A packed head's float32 output as it is: rounding it to the activations'
        # bfloat16 and back for the sampler was two more copies of the logits a step
        # (6 % of a perf profile of Gemma 3 at C=64 on an Intel Xeon).
        unrounded = getattr(self.lm_head, "unrounded", None)
        logits: torch.Tensor = unrounded(hidden) if unrounded else self.lm_head(hidden)
        # In place, on the head's own output: at 64 rows of Gemma 3's 262 144-token
        # vocabulary each new tensor was 67 MB, fresh pages from the kernel every step.
        if self.multiply is not None:
            logits.mul_(self.multiply)
        if self.divide is not None:
            logits.div_(self.divide)
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits


def _decoder_of(model: Any) -> Any:
    """The decoder stack under the LM head. transformers' ``get_decoder`` finds it through
    ``base_model_prefix``, which for some heads (Llama 4's text head: prefix
    ``language_model``, module ``model``) names no attribute, and then answers the head
    itself; the module transformers' causal-LM heads keep it in is ``model``."""
    decoder = model.get_decoder()
    if decoder is model and isinstance(getattr(model, "model", None), torch.nn.Module):
        decoder = model.model
    return decoder


@dataclass(frozen=True)
class TokenRun:
    """``tokens`` of one sequence, written from position ``start`` of its slot: a
    prompt chunk, or a decoding row's last token and the draft that follows it."""

    start: int
    tokens: Sequence[int]


class ModelRunner:
    def __init__(self, model: Any, cache: SlotKVCache, *, context_length: int) -> None:
        self.model = model
        self.decoder = _decoder_of(model)
        self.head = LogitsHead(model)
        self.cache = cache
        self.context_length = context_length
        # Mixed steps wrap the model's attention: SDPA, or its own eager attention.
        implementation = model.config._attn_implementation
        wrapped = {"sdpa": packed.PACKED}
        if packed.has_own_eager(model):
            wrapped["eager"] = packed.PACKED_EAGER
        # A per-sequence state cannot take a packed step's drafts (a rejected one would
        # leave it advanced) and reads its rows by consecutive slots.
        self.why_unpacked = (
            "carry a per-sequence recurrent state that a rejected draft would leave advanced"
            if cache.holds_state
            else "need the model's attention to go through transformers' attention "
            "interface (SDPA or its own eager attention)"
        )
        if (
            implementation in wrapped
            and packed.calls_attention_interface(model)
            and not cache.holds_state
        ):
            implementation = wrapped[implementation]
            model.set_attn_implementation(implementation)
        self.packs = implementation in packed.PACKED_WRAPS
        self.layout = AttentionLayout.for_model(model)
        # Fixed-shape decode (captured on CUDA), set by the engine's assembly.
        self.static: StaticDecode | None = None
        # The decode step without transformers' layers (``direct_decode``), where the
        # assembly chose it and found it agrees with them.
        self.direct: DirectDecode | None = None
        self.decode_path: DecodePath | None = None  # which of the two, and why

    # -------------------------------------------------------------------- plans

    def execute(self, plan: StepPlan) -> StepSamples:
        """Run ``plan``'s forward and sample it where its logits are."""
        decode_hidden = chunk_hidden = None
        decode_logits = None
        if plan.kind is ForwardKind.MIXED or plan.drafted:
            groups = [(0, [TokenRun(run.start, run.tokens) for run in plan.decode])]
            if plan.kind is ForwardKind.MIXED:
                groups.append((plan.chunk_slot, [TokenRun(c.start, c.tokens) for c in plan.chunks]))
            hidden = self.forward_packed(groups)
            decode_hidden = hidden[0]
            chunk_hidden = hidden[1] if plan.kind is ForwardKind.MIXED else None
        elif plan.kind is ForwardKind.DECODE:
            decode_logits = self._decode_step(plan)
        else:
            chunk_hidden = self._prefill(plan)
        if decode_hidden is not None:
            lengths = torch.tensor([len(run.tokens) for run in plan.decode])
            valid = torch.arange(decode_hidden.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
            decode_logits = self.head(decode_hidden[valid.to(decode_hidden.device)])
        first, scored = self._chunk_logits(plan, chunk_hidden)
        # The decode rows as the head gave them: at 64 rows of Gemma 3's vocabulary a
        # bfloat16 head's output widened to float32 was a 67 MB copy a step (≈10 % of a
        # perf profile at C=64 on an Intel Xeon, its page faults included), and a
        # greedy row needs none of it.
        logits = StepLogits(decode=decode_logits, first=first, scored=scored)
        return sample_plan(plan, logits)

    def _decode_step(self, plan: StepPlan) -> torch.Tensor:
        last = [run.tokens[0] for run in plan.decode]
        at = [run.start for run in plan.decode]
        if self.static is not None:
            logits = self.static.run(last, at)
            if logits is not None:
                return logits
        if self.direct is not None:
            return self._direct_step(last, at)
        device = self.cache.device
        ids = torch.tensor(last, dtype=torch.long).unsqueeze(1)
        positions = torch.tensor(at, dtype=torch.long).unsqueeze(1)
        hidden = self.forward(slice(0, len(last)), ids.to(device), positions.to(device))
        return self.head(hidden[:, -1])

    def _direct_step(self, last: list[int], at: list[int]) -> torch.Tensor:
        assert self.direct is not None
        self._fit(max(at) + 1)
        ids = torch.tensor(last, dtype=torch.long)
        positions = torch.tensor(at, dtype=torch.long)
        return self.head(self.direct.hidden(ids, positions))

    def _prefill(self, plan: StepPlan) -> torch.Tensor:
        chunks = plan.chunks
        width = max(len(c.tokens) for c in chunks)
        reads = max(c.start + len(c.tokens) for c in chunks)
        if self.direct is not None and self.packs and packed.takes_own(width, reads):
            # Short chunks through the direct step, a token a row (``forward_packed``).
            runs = [TokenRun(c.start, c.tokens) for c in chunks]
            return self.forward_packed([(plan.chunk_slot, runs)])[0]
        if self.cache.holds_state:
            return self._prefill_one_by_one(plan, width)
        ids = torch.zeros(len(chunks), width, dtype=torch.long)
        positions = torch.zeros(len(chunks), width, dtype=torch.long)
        for r, chunk in enumerate(chunks):
            ids[r, : len(chunk.tokens)] = torch.tensor(chunk.tokens)
            # Padding continues the positions; its KV lands beyond the sequence's valid
            # length and is overwritten before anything reads it.
            positions[r] = torch.arange(chunk.start, chunk.start + width)
        device = self.cache.device
        rows = slice(plan.chunk_slot, plan.chunk_slot + len(chunks))
        return self.forward(rows, ids.to(device), positions.to(device))

    def _prefill_one_by_one(self, plan: StepPlan, width: int) -> torch.Tensor:
        """Each chunk in a forward of its own, unpadded: padding would run through a
        recurrent state, and a chunk that starts a prompt cannot share a forward with
        one that goes on from its state. Hidden states ``[chunks, width, H]``."""
        device = self.cache.device
        hidden: torch.Tensor | None = None
        for r, chunk in enumerate(plan.chunks):
            n = len(chunk.tokens)
            ids = torch.tensor([chunk.tokens], dtype=torch.long, device=device)
            positions = torch.arange(chunk.start, chunk.start + n, device=device).unsqueeze(0)
            slot = plan.chunk_slot + r
            out = self.forward(slice(slot, slot + 1), ids, positions)[0]
            if hidden is None:
                hidden = out.new_zeros(len(plan.chunks), width, out.shape[-1])
            hidden[r, :n] = out
        assert hidden is not None
        return hidden

    def _chunk_logits(
        self, plan: StepPlan, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """From the chunks' hidden states ``[chunks, width, H]``: the completing chunks'
        last-position logits, and each chunk's scored positions' logits."""
        scored: list[torch.Tensor | None] = []
        last: list[torch.Tensor] = []
        for r, chunk in enumerate(plan.chunks):
            assert hidden is not None
            scored.append(self.head(hidden[r, : chunk.scored]).float() if chunk.scored else None)
            if chunk.completes:
                last.append(hidden[r, len(chunk.tokens) - 1])
        first = self.head(torch.stack(last)).float() if last else None
        return first, scored

    # ----------------------------------------------------------------- forwards

    def _fit(self, needed: int) -> None:
        """Grow the cache's capacity to hold positions ``< needed``."""
        cache = self.cache
        if needed > cache.capacity:
            cache.resize(cache.slots, min(max(needed, cache.capacity * 2), self.context_length))

    def forward(
        self, rows: slice | torch.Tensor, ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Run the decoder; row ``r`` holds ``ids[r]`` at ``positions[r]`` of its slot.
        Returns the last hidden states ``[rows, T, H]``."""
        self._fit(int(positions.max().item()) + 1)
        read_len = self.cache.bind(rows, positions)
        return self.decode(ids, positions, self.layout.masks(positions, read_len))

    def forward_packed(
        self, groups: Sequence[tuple[int, Sequence[TokenRun]]]
    ) -> list[torch.Tensor]:
        """One packed forward over groups of consecutive slots: run ``r`` of the group
        ``(first, runs)`` writes its tokens into slot ``first + r``. A step's decode rows
        are one group (a token each, or the last token and a draft to verify), its
        prompt chunks another: they attend apart, so that a decode row is not padded
        to a chunk's width.

        Where the direct step serves the layers and every group is short enough for its
        attention (``packed.takes_own``), the step runs through it, a token a row;
        otherwise through transformers' layers, its groups attending through SDPA or the
        direct step's attention op.

        Returns each group's hidden states ``[runs, W, H]`` (``W`` its longest run; a
        shorter run repeats its last state)."""
        assert self.packs, "packed steps need the packed attention"
        device = self.cache.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        shapes: list[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for first, runs in groups:
            lengths = [len(run.tokens) for run in runs]
            width = max(lengths)
            gather = torch.empty(len(runs), width, dtype=torch.long)
            run_positions = torch.empty(len(runs), width, dtype=torch.long)
            for r, run in enumerate(runs):
                n = lengths[r]
                taken = torch.arange(width).clamp(max=n - 1)
                gather[r] = len(ids) + taken
                run_positions[r] = run.start + taken
                ids.extend(run.tokens)
                positions.extend(range(run.start, run.start + n))
                slots.extend([first + r] * n)
            valid = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
            shapes.append((slice(first, first + len(runs)), gather, valid, run_positions))
        flat_positions = torch.tensor(positions, dtype=torch.long, device=device)
        self._fit(max(positions) + 1)
        # Where the direct step serves the layers, their attention is its op's too; and
        # where every group takes that attention, the whole step is the direct step's,
        # a token a row: no transformers layers, masks or packed gathers.
        own = self.direct.attention if self.direct is not None else None
        if self.direct is not None and all(
            packed.takes_own(gather.shape[1], int(run_positions.max()) + 1)
            for _, gather, _, run_positions in shapes
        ):
            ids_at = torch.tensor(ids, dtype=torch.long)
            hidden = self.direct.hidden(ids_at, flat_positions, torch.tensor(slots))
            return [hidden[gather] for _, gather, _, _ in shapes]
        self.cache.bind_packed(torch.tensor(slots, device=device), flat_positions, min(positions))
        row_groups = tuple(
            packed.group(
                rows, gather.to(device), valid.to(device), run_positions.to(device), self.layout
            )
            for rows, gather, valid, run_positions in shapes
        )
        batch = packed.PackedBatch(row_groups, self.layout.layer_types, own)
        ids_row = torch.tensor(ids, dtype=torch.long, device=device).unsqueeze(0)
        with packed.bound(batch):
            # The masks are the groups'; the model is handed a placeholder 4-D mask,
            # which transformers passes through untouched.
            hidden = self.decode(ids_row, flat_positions.unsqueeze(0), _NO_MASK)[0]
        return [hidden[group.gather] for group in row_groups]

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, mask: Any) -> torch.Tensor:
        """The decoder over a cache already bound for this forward."""
        out = self.decoder(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
        )
        hidden: torch.Tensor = out.last_hidden_state
        return hidden

    @torch.inference_mode()
    def self_check(self) -> None:
        """Compare probes' logits on this path with the model's own forward; raises
        ``UnsupportedModelError`` where they differ (or this path fails).

        A prompt prefilled in one row must give the model's own logits (and, for a model
        with a recurrent state, the same prompt prefilled in two chunks). Then one
        decode step of two rows whose slots hold prompts of different lengths must give
        each row the logits it gets when it steps alone, so that a model which derives
        positions or masks from the batch as a whole (not from the positions and masks
        passed) is caught. A quantised model skips that step: its GEMMs round
        differently at each row count, so its rows differ alone and together anyway;
        whether positions come from the batch is its architecture's, which the same
        model unquantised (and the architecture matrix) checks. (A decode step is not
        compared with the model's cache-free forward: some models' cached and
        cache-free paths differ, OLMo hybrid's by 0.6 nats on a random model, where
        Sluice agrees with ``generate``.)"""
        architecture = type(self.model).__name__
        self._check_batch_wide_positions(architecture)
        length = min(_PROBE_TOKENS, self.cache.capacity, self.context_length - 1)
        vocab = int(self.model.config.vocab_size)
        device = self.cache.device
        ids = (torch.arange(length + 1, device=device) * 7919 % max(vocab - 1, 1) + 1).tolist()
        short = max(1, length // 2)
        other = [(t * 31 + 5) % max(vocab - 1, 1) + 1 for t in ids[: short + 1]]
        slots = self.cache.slots
        if slots < 2:
            self.cache.resize(2, self.cache.capacity)
        try:
            got = self._probe(architecture, [ids[:length]], [(0, 0)])[0]
            whole = torch.tensor([ids[:length]], device=device)
            expected = self.model(input_ids=whole, use_cache=False).logits[0].float()
            drift = _drift(got, expected)
            if not drift <= _TOLERANCE.get(self.cache.dtype, 0.25):
                raise UnsupportedModelError(
                    f"{architecture}: Sluice's forward does not reproduce the model's own "
                    f"logits (log-probabilities differ by up to {drift:.3g})"
                )
            if self.cache.holds_state:
                self._check_carried_state(architecture, ids[:length], expected)
            if quantization_of(self.model) is not None:
                return
            self._probe(architecture, [other[:short]], [(1, 0)])
            steps = [(ids, (0, length)), (other, (1, short))]
            # A recurrent state is advanced by each step: the rows start again from it.
            before = self.cache.snapshot()
            alone = [self._probe(architecture, [seq], [row])[0] for seq, row in steps]
            self.cache.restore(before)
            together = self._probe(architecture, [seq for seq, _ in steps], [r for _, r in steps])
            drift = max(_drift(a, b) for a, b in zip(together, alone, strict=True))
            if not drift <= _TOLERANCE.get(self.cache.dtype, 0.25):
                raise UnsupportedModelError(
                    f"{architecture}: a row's logits depend on the other rows of its step "
                    f"(log-probabilities differ by up to {drift:.3g}); the model takes "
                    "positions or masks from the whole batch"
                )
        finally:
            if slots < 2:
                self.cache.resize(slots, self.cache.capacity)

    def _check_carried_state(
        self, architecture: str, ids: list[int], expected: torch.Tensor
    ) -> None:
        """A prompt prefilled in two chunks, the second going on from the recurrent
        state the first left, must give the model's own logits, and must depend on that
        state: Mamba's selective scan (Mamba, FalconMamba, Jamba) starts every
        multi-token forward from a zero state, so chunked prefill would serve it wrong
        (by little where a random model's state fades fast, hence the second probe,
        over a doubled state)."""
        half = len(ids) // 2
        self._probe(architecture, [ids[:half]], [(0, 0)])
        before = self.cache.snapshot()
        carried = self._probe(architecture, [ids], [(0, half)])[0]
        after = self.cache.snapshot()
        drift = _drift(carried, expected[half:])
        ignored = False
        self.cache.restore(before)
        if self.cache.scale_recurrent_states(2.0):
            doubled = self._probe(architecture, [ids], [(0, half)])[0]
            ignored = bool(torch.equal(doubled, carried))
        self.cache.restore(after)  # slot 0 holds the whole prompt again, as carried
        if ignored or not drift <= _TOLERANCE.get(self.cache.dtype, 0.25):
            detail = (
                "they do not change when that state is doubled"
                if ignored
                else f"log-probabilities differ by up to {drift:.3g}"
            )
            raise UnsupportedModelError(
                f"{architecture}: a prompt continued from its recurrent state does not "
                f"give the model's own logits ({detail}); its layers cannot start a "
                "forward from a carried state, which chunked prefill needs"
            )

    def _check_batch_wide_positions(self, architecture: str) -> None:
        """Llama 4 scales its NoPE layers' queries by a position it takes from the cache's
        length (one for the whole batch), not from each row's ``position_ids``; the scale
        is 1 below ``floor_scale`` positions, so it is served only within that context
        (the probes are too short to see it)."""
        config = self.model.config
        floor_scale = getattr(config, "floor_scale", None)
        tuned = getattr(config, "attn_temperature_tuning", False)
        if tuned and isinstance(floor_scale, int) and self.context_length >= floor_scale:
            raise UnsupportedModelError(
                f"{architecture} scales its NoPE layers' queries by one position for the "
                f"whole batch (attn_temperature_tuning) past {floor_scale - 1} tokens, "
                f"which Sluice's rows at their own positions cannot take: serve it with "
                f"--context-length {floor_scale - 1} or less"
            )

    def _probe(
        self, architecture: str, sequences: list[list[int]], rows: list[tuple[int, int]]
    ) -> list[torch.Tensor]:
        """Run ``sequences[r][start:]`` in slot ``slot`` (``rows[r] = (slot, start)``,
        consecutive slots; the same width); each row's logits at the positions run."""
        device = self.cache.device
        width = len(sequences[0]) - rows[0][1]
        ids = torch.tensor([seq[start:] for seq, (_, start) in zip(sequences, rows, strict=True)])
        positions = torch.stack([torch.arange(start, start + width) for _, start in rows])
        first = rows[0][0]
        # Whatever a model's own code raises on this path (its asserts included) means
        # it cannot be served this way: a refusal naming it, never a traceback.
        try:
            hidden = self.forward(
                slice(first, first + len(rows)), ids.to(device), positions.to(device)
            )
        except Exception as exc:
            raise UnsupportedModelError(
                f"{architecture} cannot run over Sluice's slot KV cache: "
                f"{str(exc) or type(exc).__name__}"
            ) from exc
        try:
            return [self.head(hidden[r]).float() for r in range(len(rows))]
        except Exception as exc:
            # A model with a projection of its own between the decoder and the LM head
            # (ELECTRA's generator head) is one the runner's head does not know.
            raise UnsupportedModelError(
                f"{architecture}: its LM head does not take the decoder's last hidden "
                f"states as they are: {exc}"
            ) from exc


def _drift(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference between two sets of logits' log-probabilities."""
    return float((got.log_softmax(-1) - expected.log_softmax(-1)).abs().max())

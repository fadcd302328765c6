"""Sampling one executed plan, where its logits are: every decode-run position, every
completed prompt's first token and every scored prompt position, in batched calls
of ``sampler``; only the chosen tokens and the logprobs asked for leave the device.

A decode run's draft is verified by ``update`` position by position, each position
kept only while the one before it was the draft's. So position ``j`` of a run is
sampled here as a plain step would sample it after ``draft[:j]`` was kept: its
penalties and ``min_tokens`` count ``generated + draft[:j]``, its grammar mask is
the matcher's after consuming ``draft[:j]`` (consumed here, then rolled back), and
a seeded row draws its uniforms in position order, so that what ``update`` keeps is
exactly what sampling one position at a time gives. Positions past the first miss
are discarded; a seeded row's generator is rewound to what was kept
(``rewind``).
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import torch

from sluice.events.types import TokenLogprob

from .grammar import TokenGrammar
from .plan import DecodeRun, PromptChunk, Sampled, StepLogits, StepPlan, StepSamples
from .sampler import (
    RowMasks,
    RowState,
    SampleResult,
    grammar_masks,
    prompt_logprobs,
    sample,
)


def sample_plan(plan: StepPlan, logits: StepLogits) -> StepSamples:
    decode: tuple[Sampled, ...] = ()
    rng_before: tuple[Any, ...] = ()
    if plan.decode:
        assert logits.decode is not None
        decode, rng_before = _sample_runs(plan.decode, logits.decode, plan.grammar)
    return StepSamples(
        decode=decode,
        rng_before=rng_before,
        first=_first_tokens(plan.chunks, logits.first, plan.grammar),
        prompt_logprobs=tuple(
            _prompt_logprobs(chunk, scored)
            for chunk, scored in zip(plan.chunks, logits.scored, strict=True)
        ),
    )


def rewind(rng: random.Random, before: Any, draws: int) -> None:
    """Leave ``rng`` as if only ``draws`` uniforms had been drawn since ``before``."""
    rng.setstate(before)
    for _ in range(draws):
        rng.random()


def _sample_runs(
    runs: tuple[DecodeRun, ...], logits: torch.Tensor, grammar: TokenGrammar | None
) -> tuple[tuple[Sampled, ...], tuple[Any, ...]]:
    rows: list[RowState] = []
    for run in runs:
        row = run.seq.row
        rows.append(row)
        rows.extend(
            replace(row, generated=[*row.generated, *run.draft[:j]])
            for j in range(1, len(run.tokens))
        )
    # Only a seeded row has a generator of its own to rewind; a shared one is left
    # drawn on (its draws promise nothing).
    rng_before = tuple(
        run.seq.row.rng.getstate()
        if run.draft and run.seq.row.params.seed is not None and not run.seq.row.params.greedy
        else None
        for run in runs
    )
    masks = None
    if grammar is not None and any(run.draft for run in runs):
        masks = _draft_masks(runs, rows, grammar, logits.shape[1])
    return _sampled(sample(logits, rows, grammar, masks=masks)), rng_before


def _sampled(result: SampleResult) -> tuple[Sampled, ...]:
    errors = result.errors or [None] * len(result.tokens)
    return tuple(
        Sampled(token, lp, error)
        for token, lp, error in zip(result.tokens, result.logprobs, errors, strict=True)
    )


def _draft_masks(
    runs: tuple[DecodeRun, ...], rows: list[RowState], grammar: TokenGrammar, vocab: int
) -> RowMasks | None:
    """The constrained rows' masks at every draft position: one batched mask call per
    depth, each matcher advanced over its draft as far as the grammar accepts it, then
    rolled back. Positions past a draft token the grammar rejects are never kept (the
    mask before them excludes that token), so they go unmasked."""
    offsets: list[int] = []
    at = 0
    for run in runs:
        offsets.append(at)
        at += len(run.tokens)
    reach = {
        i: run.seq.row.matcher.valid_prefix(run.draft)
        for i, run in enumerate(runs)
        if run.seq.row.matcher is not None
    }
    if not reach:
        return None
    which: list[int] = []
    parts: list[torch.Tensor] = []
    consumed = dict.fromkeys(reach, 0)
    try:
        for depth in range(max(len(runs[i].tokens) for i in reach)):
            here = [offsets[i] + depth for i in reach if depth <= reach[i]]
            if not here:
                break
            which.extend(here)
            parts.append(grammar_masks(rows, here, grammar, vocab))
            for i in reach:
                if depth < reach[i]:
                    matcher = runs[i].seq.row.matcher
                    assert matcher is not None
                    matcher.consume(runs[i].draft[depth])
                    consumed[i] += 1
    finally:
        for i, n in consumed.items():
            matcher = runs[i].seq.row.matcher
            assert matcher is not None
            matcher.rollback(n)
    return RowMasks(which, torch.cat(parts))


def _first_tokens(
    chunks: tuple[PromptChunk, ...], logits: torch.Tensor | None, grammar: TokenGrammar | None
) -> tuple[Sampled | None, ...]:
    """Per chunk, the first token of the prompt it completes (``logits``: a row per
    completing chunk); rows that only score their prompt (``max_tokens == 0``) draw
    nothing."""
    completing = [i for i, chunk in enumerate(chunks) if chunk.completes]
    wanted = [j for j, i in enumerate(completing) if chunks[i].seq.row.params.max_tokens > 0]
    first: list[Sampled | None] = [None] * len(chunks)
    if wanted:
        assert logits is not None
        index = torch.tensor(wanted, dtype=torch.long, device=logits.device)
        rows = [chunks[completing[j]].seq.row for j in wanted]
        for j, sampled in zip(wanted, _sampled(sample(logits[index], rows, grammar)), strict=True):
            first[completing[j]] = sampled
    return tuple(first)


def _prompt_logprobs(
    chunk: PromptChunk, scored: torch.Tensor | None
) -> tuple[TokenLogprob, ...] | None:
    k = chunk.seq.row.params.prompt_logprobs
    if k is None or scored is None:
        return None
    targets = chunk.seq.prompt[chunk.start + 1 : chunk.start + 1 + chunk.scored]
    return tuple(prompt_logprobs(scored, targets, k))

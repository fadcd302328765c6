"""Batched sampling: one set of tensor operations for every row of a step.

Each row carries its own parameters; the work is vectorised over the rows that need
it (penalties, filtering, logprobs) and skipped entirely when no row does. Random
draws come from each sequence's own ``random.Random`` (seeded when the request
gives a seed), and sampling is an inverse-CDF lookup, so a seeded request gives
the same tokens whatever else is in the batch (up to float noise in the logits).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sluice.events.types import TokenLogprob

from .grammar import GrammarMatcher, TokenGrammar
from .params import SamplingParams


@dataclass(slots=True)
class RowState:
    """What the sampler needs to know about one row's sequence."""

    params: SamplingParams
    rng: random.Random
    prompt: Sequence[int]
    generated: list[int] = field(default_factory=list)
    # Ids that end the sequence (EOS unless ignore_eos, plus stop_token_ids): masked
    # while fewer than ``min_tokens`` tokens were generated.
    stop_ids: frozenset[int] = frozenset()
    # The grammar's state when the sequence is constrained (``params.constraint``).
    matcher: GrammarMatcher | None = None


@dataclass(frozen=True, slots=True)
class SampleResult:
    tokens: list[int]
    logprobs: list[TokenLogprob | None]


def _rows_where(rows: Sequence[RowState], predicate: object) -> list[int]:
    return [i for i, r in enumerate(rows) if predicate(r)]  # type: ignore[operator]


def apply_penalties(logits: torch.Tensor, rows: Sequence[RowState], which: list[int]) -> None:
    """OpenAI presence/frequency penalties over generated tokens; SGLang's (HF's)
    repetition penalty over prompt and generated tokens. In place on ``logits``."""
    vocab = logits.shape[1]
    index = torch.tensor(which, dtype=torch.long)
    sub = logits[index]
    counts = torch.zeros(len(which), vocab, dtype=sub.dtype)
    seen = torch.zeros(len(which), vocab, dtype=torch.bool)
    for j, i in enumerate(which):
        row = rows[i]
        if row.generated:
            counts[j].index_add_(
                0,
                torch.tensor(row.generated, dtype=torch.long),
                torch.ones(len(row.generated), dtype=sub.dtype),
            )
        if row.params.repetition_penalty != 1.0:
            seen[j, torch.tensor(list(row.prompt) + row.generated, dtype=torch.long)] = True
    freq = torch.tensor([rows[i].params.frequency_penalty for i in which], dtype=sub.dtype)
    pres = torch.tensor([rows[i].params.presence_penalty for i in which], dtype=sub.dtype)
    sub -= freq.unsqueeze(1) * counts + pres.unsqueeze(1) * (counts > 0).to(sub.dtype)
    rep = torch.tensor([rows[i].params.repetition_penalty for i in which], dtype=sub.dtype)
    rep = rep.unsqueeze(1).expand_as(sub)
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalised, sub)
    logits[index] = sub


def _filter_sorted(
    probs_sorted: torch.Tensor, rows: Sequence[RowState], which: list[int]
) -> torch.Tensor:
    """Zero the sorted probabilities that top-k, top-p and min-p exclude."""
    vocab = probs_sorted.shape[1]
    ranks = torch.arange(vocab).unsqueeze(0)
    top_k = torch.tensor(
        [rows[i].params.top_k if rows[i].params.top_k > 0 else vocab for i in which]
    ).unsqueeze(1)
    keep = ranks < top_k
    top_p = torch.tensor([rows[i].params.top_p for i in which], dtype=probs_sorted.dtype)
    # Keep a token while the mass before it is below top_p (so the first always stays).
    mass_before = probs_sorted.cumsum(dim=1) - probs_sorted
    keep &= mass_before < top_p.unsqueeze(1)
    min_p = torch.tensor([rows[i].params.min_p for i in which], dtype=probs_sorted.dtype)
    keep &= probs_sorted >= (min_p * probs_sorted[:, 0]).unsqueeze(1)
    keep[:, 0] = True
    return probs_sorted * keep


def _inverse_cdf(probs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    cdf = probs.cumsum(dim=1)
    total = cdf[:, -1:]
    u = torch.tensor(uniforms, dtype=cdf.dtype).unsqueeze(1) * total
    picked = torch.searchsorted(cdf, u, right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[1] - 1)


def sample(
    logits: torch.Tensor, rows: Sequence[RowState], grammar: TokenGrammar | None = None
) -> SampleResult:
    """Choose one token per row of ``logits`` ([rows, vocab], float32, on the CPU).

    ``grammar`` is given when some row has a matcher: those rows' masks are computed
    in one batched call and every token their grammar rejects is excluded before the
    choice, greedy or sampled. Without it no row is looked at for a grammar.
    """
    raw = logits
    work = logits
    constrained = _rows_where(rows, lambda r: r.matcher is not None) if grammar else []
    penalised = _rows_where(rows, lambda r: r.params.needs_penalties)
    biased = _rows_where(rows, lambda r: bool(r.params.logit_bias))
    held = _rows_where(
        rows,
        lambda r: len(r.generated) < r.params.min_tokens and r.stop_ids and r.matcher is None,
    )
    if penalised or biased or held or constrained:
        work = logits.clone()
        if penalised:
            apply_penalties(work, rows, penalised)
        for i in biased:
            ids, bias = zip(*rows[i].params.logit_bias, strict=True)
            work[i, list(ids)] += torch.tensor(bias, dtype=work.dtype)
        for i in held:
            work[i, list(rows[i].stop_ids)] = float("-inf")
        if constrained:
            assert grammar is not None
            apply_grammar(work, rows, constrained, grammar)

    chosen = work.argmax(dim=1)
    sampled = _rows_where(rows, lambda r: not r.params.greedy)
    if sampled:
        index = torch.tensor(sampled, dtype=torch.long)
        temps = torch.tensor([rows[i].params.temperature for i in sampled], dtype=work.dtype)
        scaled = work[index] / temps.unsqueeze(1)
        uniforms = [rows[i].rng.random() for i in sampled]
        filtered = [j for j, i in enumerate(sampled) if rows[i].params.needs_filtering]
        if filtered:
            sorted_logits, order = scaled.sort(dim=1, descending=True)
            probs = _filter_sorted(
                torch.softmax(sorted_logits, dim=1), rows, [sampled[j] for j in filtered]
            )
            # Rows without filtering go through the same sorted path here: simpler, and
            # sorting is already paid for.
            unfiltered = [j for j in range(len(sampled)) if j not in set(filtered)]
            if unfiltered:
                probs[unfiltered] = torch.softmax(sorted_logits[unfiltered], dim=1)
            picks = order.gather(1, _inverse_cdf(probs, uniforms).unsqueeze(1)).squeeze(1)
        else:
            picks = _inverse_cdf(torch.softmax(scaled, dim=1), uniforms)
        chosen[index] = picks

    tokens: list[int] = chosen.tolist()
    return SampleResult(tokens, token_logprobs(raw, rows, tokens))


def apply_grammar(
    logits: torch.Tensor, rows: Sequence[RowState], which: list[int], grammar: TokenGrammar
) -> None:
    """Set to -inf every token the grammar of rows ``which`` rejects. In place.

    A row's stop ids (EOS unless ``ignore_eos``, and its ``stop_token_ids``) end the
    sequence only where the grammar accepts the text so far; while fewer than
    ``min_tokens`` are generated they are held back, unless the grammar allows
    nothing else (a complete document cannot be made longer).
    """
    matchers = [rows[i].matcher for i in which]
    allowed = grammar.allowed([m for m in matchers if m is not None], logits.shape[1])
    for j, i in enumerate(which):
        row, matcher = rows[i], matchers[j]
        if not row.stop_ids or matcher is None:
            continue
        ids = list(row.stop_ids)
        if len(row.generated) < row.params.min_tokens:
            grammar_allows = allowed[j, ids]
            allowed[j, ids] = False
            if not bool(allowed[j].any()):
                allowed[j, ids] = grammar_allows | matcher.accepting
        elif matcher.accepting:
            allowed[j, ids] = True
    blocked = ~allowed
    if len(which) == logits.shape[0]:
        logits.masked_fill_(blocked, float("-inf"))
    else:
        for j, i in enumerate(which):
            logits[i].masked_fill_(blocked[j], float("-inf"))


def token_logprobs(
    raw: torch.Tensor, rows: Sequence[RowState], tokens: list[int]
) -> list[TokenLogprob | None]:
    """Logprobs from the raw logits (before penalties and temperature), as asked."""
    out: list[TokenLogprob | None] = [None] * len(rows)
    wanted = _rows_where(rows, lambda r: r.params.logprobs is not None)
    if not wanted:
        return out
    index = torch.tensor(wanted, dtype=torch.long)
    logp = torch.log_softmax(raw[index].float(), dim=1)
    picked = logp.gather(1, torch.tensor([tokens[i] for i in wanted]).unsqueeze(1)).squeeze(1)
    k = max(rows[i].params.logprobs or 0 for i in wanted)
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k > 0:
        values, ids = logp.topk(k, dim=1)
        top_vals, top_ids = values.tolist(), ids.tolist()
    picked_list: list[float] = picked.tolist()
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs or 0
        top = tuple(zip(top_ids[j][:n], top_vals[j][:n], strict=True)) if n else ()
        out[i] = TokenLogprob(tokens[i], picked_list[j], top)
    return out


def prompt_logprobs(logits: torch.Tensor, next_tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    """Logprobs of ``next_tokens[t]`` under ``logits[t]`` (the prompt scoring of ``echo``)."""
    logp = torch.log_softmax(logits.float(), dim=1)
    ids = torch.tensor(list(next_tokens), dtype=torch.long)
    picked: list[float] = logp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    top_vals: list[list[float]] = [[] for _ in next_tokens]
    top_ids: list[list[int]] = [[] for _ in next_tokens]
    if k > 0:
        values, idx = logp.topk(k, dim=1)
        top_vals, top_ids = values.tolist(), idx.tolist()
    return [
        TokenLogprob(tok, lp, tuple(zip(top_ids[t], top_vals[t], strict=True)))
        for t, (tok, lp) in enumerate(zip(next_tokens, picked, strict=True))
    ]

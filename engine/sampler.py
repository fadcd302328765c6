"""Batched sampling: one set of tensor operations for every row of a step.

Each row carries its own parameters; the work is vectorised over the rows that need
it (penalties, filtering, logprobs) and skipped entirely when no row does. Random
draws come from each sequence's own ``random.Random`` (seeded when the request
gives a seed), and sampling is an inverse-CDF lookup, so a seeded request gives
the same tokens whatever else is in the batch (up to float noise in the logits).

What a row brings can still fail the batched call (a parameter past what a tensor
holds, a grammar that breaks mid-way): then every row is sampled alone, with the
uniforms already drawn, so the rows that do not fail get the tokens the batch would
have given them and only the failing row ends, with the error (``SampleResult.errors``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog
import torch

from sluice.events.types import TokenLogprob

from .grammar import GrammarMatcher, TokenGrammar
from .native_kernels import loaded_op
from .params import SamplingParams

log = structlog.get_logger(__name__)


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
    """One token per row; where ``errors`` has a message that row could not be sampled
    (its token is meaningless) and its sequence must end with that error."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    errors: list[str | None] | None = None


def _rows_where(rows: Sequence[RowState], predicate: object) -> list[int]:
    return [i for i, r in enumerate(rows) if predicate(r)]  # type: ignore[operator]


def apply_penalties(logits: torch.Tensor, rows: Sequence[RowState], which: list[int]) -> None:
    """OpenAI presence/frequency penalties over generated tokens; SGLang's (HF's)
    repetition penalty over prompt and generated tokens. In place on ``logits``."""
    vocab, device = logits.shape[1], logits.device
    index = torch.tensor(which, dtype=torch.long, device=device)
    sub = logits[index]
    counts = torch.zeros(len(which), vocab, dtype=sub.dtype, device=device)
    seen = torch.zeros(len(which), vocab, dtype=torch.bool, device=device)
    for j, i in enumerate(which):
        row = rows[i]
        if row.generated:
            ids = torch.tensor(row.generated, dtype=torch.long, device=device)
            counts[j].index_add_(
                0, ids, torch.ones(len(row.generated), dtype=sub.dtype, device=device)
            )
        if row.params.repetition_penalty != 1.0:
            ids = torch.tensor(list(row.prompt) + row.generated, dtype=torch.long, device=device)
            seen[j, ids] = True

    def per_row(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=sub.dtype, device=device).unsqueeze(1)

    freq = per_row([rows[i].params.frequency_penalty for i in which])
    pres = per_row([rows[i].params.presence_penalty for i in which])
    sub -= freq * counts + pres * (counts > 0).to(sub.dtype)
    rep = per_row([rows[i].params.repetition_penalty for i in which])
    rep = rep.expand_as(sub)
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalised, sub)
    logits[index] = sub


def _filter_sorted(
    probs_sorted: torch.Tensor, rows: Sequence[RowState], which: list[int]
) -> torch.Tensor:
    """Zero the sorted probabilities that top-k, top-p and min-p exclude."""
    vocab, device = probs_sorted.shape[1], probs_sorted.device
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    top_k = torch.tensor(
        [min(rows[i].params.top_k, vocab) if rows[i].params.top_k > 0 else vocab for i in which],
        device=device,
    ).unsqueeze(1)
    keep = ranks < top_k
    top_p = torch.tensor(
        [rows[i].params.top_p for i in which], dtype=probs_sorted.dtype, device=device
    )
    # Keep a token while the mass before it is below top_p (so the first always stays).
    mass_before = probs_sorted.cumsum(dim=1) - probs_sorted
    keep &= mass_before < top_p.unsqueeze(1)
    min_p = torch.tensor(
        [rows[i].params.min_p for i in which], dtype=probs_sorted.dtype, device=device
    )
    keep &= probs_sorted >= (min_p * probs_sorted[:, 0]).unsqueeze(1)
    keep[:, 0] = True
    return probs_sorted * keep


def _inverse_cdf(probs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    cdf = probs.cumsum(dim=1)
    total = cdf[:, -1:]
    u = torch.tensor(uniforms, dtype=cdf.dtype, device=cdf.device).unsqueeze(1) * total
    picked = torch.searchsorted(cdf, u, right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[1] - 1)


@dataclass(frozen=True, slots=True)
class RowMasks:
    """Grammar masks computed ahead: ``allowed[j]`` is row ``rows[j]``'s allowed tokens."""

    rows: list[int]
    allowed: torch.Tensor


def sample(
    logits: torch.Tensor,
    rows: Sequence[RowState],
    grammar: TokenGrammar | None = None,
    *,
    masks: RowMasks | None = None,
) -> SampleResult:
    """Choose one token per row of ``logits`` (see :func:`_sample_batch`); a row whose
    sampling raises fails alone (see the module)."""
    # Drawn before anything can fail, so that a row sampled again alone draws the same.
    uniforms = {i: row.rng.random() for i, row in enumerate(rows) if not row.params.greedy}
    try:
        return _sample_batch(logits, rows, grammar, masks, uniforms)
    except Exception as exc:  # noqa: BLE001 - what one row brings must not end the others
        if len(rows) == 1:
            return SampleResult([-1], [None], [_describe(exc)])
        log.warning("a batched sampling step failed; sampling its rows alone", error=str(exc))
    tokens: list[int] = []
    logprobs: list[TokenLogprob | None] = []
    errors: list[str | None] = []
    for i, row in enumerate(rows):
        try:
            alone = _sample_batch(
                logits[i : i + 1],
                [row],
                grammar,
                _masks_of_row(masks, i),
                {0: uniforms[i]} if i in uniforms else {},
            )
        except Exception as exc:  # noqa: BLE001 - see above
            tokens.append(-1)
            logprobs.append(None)
            errors.append(_describe(exc))
            continue
        tokens.extend(alone.tokens)
        logprobs.extend(alone.logprobs)
        errors.append(None)
    return SampleResult(tokens, logprobs, errors)


def _describe(exc: Exception) -> str:
    return f"sampling failed: {type(exc).__name__}: {exc}"


def _masks_of_row(masks: RowMasks | None, i: int) -> RowMasks | None:
    if masks is None or i not in masks.rows:
        return None
    j = masks.rows.index(i)
    return RowMasks([0], masks.allowed[j : j + 1])


def _sample_batch(
    logits: torch.Tensor,
    rows: Sequence[RowState],
    grammar: TokenGrammar | None,
    masks: RowMasks | None,
    uniforms: dict[int, float],
) -> SampleResult:
    """Choose one token per row of ``logits`` ([rows, vocab], float32 or the head's
    own dtype), on the device the logits are on: only the chosen tokens and the
    logprobs asked for leave it. What is computed on (penalties, biases, masks,
    temperature, logprobs) is widened to float32 first; a greedy row is chosen from
    the logits as they are, which widening leaves in the same order.

    ``grammar`` is given when some row has a matcher: those rows' masks are computed
    in one batched call at the matchers' current states, and every token their
    grammar rejects is excluded before the choice, greedy or sampled. ``masks`` are
    masks computed ahead instead (at states a draft leads to: ``step_sampler``).
    Without either no row is looked at for a grammar.
    """
    device = logits.device
    raw = logits
    work = logits
    if masks is None and grammar is not None:
        constrained = _rows_where(rows, lambda r: r.matcher is not None)
        if constrained:
            masks = RowMasks(
                constrained, grammar_masks(rows, constrained, grammar, logits.shape[1])
            )
    penalised = _rows_where(rows, lambda r: r.params.needs_penalties)
    biased = _rows_where(rows, lambda r: bool(r.params.logit_bias))
    held = _rows_where(
        rows,
        lambda r: len(r.generated) < r.params.min_tokens and r.stop_ids and r.matcher is None,
    )
    if penalised or biased or held or masks is not None:
        work = logits.to(torch.float32, copy=True)
        if penalised:
            apply_penalties(work, rows, penalised)
        for i in biased:
            ids, bias = zip(*rows[i].params.logit_bias, strict=True)
            work[i, list(ids)] += torch.tensor(bias, dtype=work.dtype, device=device)
        for i in held:
            work[i, list(rows[i].stop_ids)] = float("-inf")
        if masks is not None:
            _block(work, masks)

    chosen = _argmax(work)
    sampled = _rows_where(rows, lambda r: not r.params.greedy)
    if sampled:
        index = torch.tensor(sampled, dtype=torch.long, device=device)
        temps = torch.tensor(
            [rows[i].params.temperature for i in sampled], dtype=torch.float32, device=device
        )
        scaled = work[index].float() / temps.unsqueeze(1)
        drawn_for = [uniforms[i] for i in sampled]
        # Filtered rows draw from their sorted, filtered distribution, the others from
        # the plain one: each row as it would alone, so that a seeded request draws the
        # same tokens whoever shares its batch.
        filtered = [j for j, i in enumerate(sampled) if rows[i].params.needs_filtering]
        plain = [j for j, i in enumerate(sampled) if not rows[i].params.needs_filtering]
        picks = torch.empty(len(sampled), dtype=torch.long, device=device)
        if filtered:
            at = torch.tensor(filtered, dtype=torch.long, device=device)
            sorted_logits, order = scaled[at].sort(dim=1, descending=True)
            probs = _filter_sorted(
                torch.softmax(sorted_logits, dim=1), rows, [sampled[j] for j in filtered]
            )
            drawn = _inverse_cdf(probs, [drawn_for[j] for j in filtered])
            picks[at] = order.gather(1, drawn.unsqueeze(1)).squeeze(1)
        if plain:
            at = torch.tensor(plain, dtype=torch.long, device=device)
            picks[at] = _inverse_cdf(
                torch.softmax(scaled[at], dim=1), [drawn_for[j] for j in plain]
            )
        chosen[index] = picks

    tokens: list[int] = chosen.tolist()
    return SampleResult(tokens, token_logprobs(raw, rows, tokens))


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, as ``argmax(dim=1)``: Sluice's kernel on contiguous float32 or
    bfloat16 CPU logits where it is loaded (torch's compares one value at a time: 14.5
    ms at 64 rows of Gemma 3's vocabulary on an Intel Xeon, the kernel 2.4), else
    torch's."""
    if (
        logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.is_contiguous()
    ):
        own = loaded_op("argmax_rows")
        if own is not None:
            chosen: torch.Tensor = own(logits)
            return chosen
    return logits.argmax(dim=1)


def grammar_masks(
    rows: Sequence[RowState], which: list[int], grammar: TokenGrammar, vocab: int
) -> torch.Tensor:
    """``[len(which), vocab]`` booleans: the tokens the grammars of rows ``which`` allow
    next, at their matchers' current states (on the host).

    A row's stop ids (EOS unless ``ignore_eos``, and its ``stop_token_ids``) end the
    sequence only where the grammar accepts the text so far; while fewer than
    ``min_tokens`` are generated they are held back, unless the grammar allows
    nothing else (a complete document cannot be made longer).
    """
    matchers = [rows[i].matcher for i in which]
    allowed = grammar.allowed([m for m in matchers if m is not None], vocab)
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
    return allowed


def _block(logits: torch.Tensor, masks: RowMasks) -> None:
    """Set to -inf every token ``masks`` does not allow. In place."""
    blocked = ~masks.allowed.to(logits.device, non_blocking=True)
    if len(masks.rows) == logits.shape[0]:
        logits.masked_fill_(blocked, float("-inf"))
    else:
        index = torch.tensor(masks.rows, dtype=torch.long, device=logits.device)
        logits[index] = logits[index].masked_fill(blocked, float("-inf"))


def token_logprobs(
    raw: torch.Tensor, rows: Sequence[RowState], tokens: list[int]
) -> list[TokenLogprob | None]:
    """Logprobs from the raw logits (before penalties and temperature), as asked."""
    out: list[TokenLogprob | None] = [None] * len(rows)
    wanted = _rows_where(rows, lambda r: r.params.logprobs is not None)
    if not wanted:
        return out
    device = raw.device
    index = torch.tensor(wanted, dtype=torch.long, device=device)
    logp = torch.log_softmax(raw[index].float(), dim=1)
    ids = torch.tensor([tokens[i] for i in wanted], dtype=torch.long, device=device)
    picked = logp.gather(1, ids.unsqueeze(1)).squeeze(1)
    k = min(max(rows[i].params.logprobs or 0 for i in wanted), logp.shape[1])
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
    ids = torch.tensor(list(next_tokens), dtype=torch.long, device=logits.device)
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

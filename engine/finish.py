"""When a sequence ends: the finish policy, a pure function of one sampled token.

A sampled token is taken by its sequence (``Sequence.take``), which advances its
grammar (if any) over the token and asks ``finish_after`` whether the sequence ends
there and why; nothing here touches the cache, the batch or the events.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

from sluice.events.types import EngineFinishReason

from .params import SamplingParams


@dataclass(frozen=True, slots=True)
class GrammarVerdict:
    """The grammar matcher after the token: whether it took it, and whether it is done."""

    accepted: bool
    stopped: bool
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Finish:
    reason: EngineFinishReason
    matched_token: int | None = None
    error: str | None = None


def finish_after(
    token: int,
    *,
    generated: int,
    params: SamplingParams,
    stop_ids: Set[int],
    prompt_len: int,
    context_length: int,
    grammar: GrammarVerdict | None,
) -> Finish | None:
    """Why the sequence ends after sampling ``token`` (its ``generated``-th), or None.

    In order: a stop id ends it once ``min_tokens`` are out (a constrained row's mask
    lets a stop id through only where the grammar may end, so there it always ends);
    a token the grammar rejects aborts it (the mask makes that impossible: never go on
    outside the grammar); a complete grammar that allows nothing more stops it; then
    ``max_tokens`` and the context length."""
    if token in stop_ids and (generated >= params.min_tokens or grammar is not None):
        return Finish("stop", matched_token=token)
    if grammar is not None and not grammar.accepted:
        return Finish("abort", error=f"the grammar rejected token {token}: {grammar.error}")
    if grammar is not None and grammar.stopped:
        return Finish("stop")
    if generated >= params.max_tokens or prompt_len + generated >= context_length:
        return Finish("length")
    return None

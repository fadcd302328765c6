"""One sequence as the scheduler holds it: its spec, where its KV lives, its sampling
state, and its place in the event numbering."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sluice.events.types import TokenLogprob

from .finish import Finish, GrammarVerdict, finish_after
from .interface import EventSink
from .params import SequenceSpec
from .sampler import RowState
from .speculative import NgramDrafter


def common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix, by binary search over C-speed slice compares."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(eq=False)
class Sequence:
    spec: SequenceSpec
    sink: EventSink
    row: RowState
    slot: int = -1
    kv_len: int = 0  # positions of this sequence whose KV is in its slot
    cached_tokens: int = 0
    seq_no: int = 0
    cancelled: bool = False
    refusal: str | None = None  # why it cannot run (its token ids): ends at admission
    prompt_lps: list[TokenLogprob | None] = field(default_factory=list)
    # A constrained sequence waits for its grammar's compile (on a worker thread).
    grammar_ready: Future[Any] | None = None
    # With ``--speculative-algorithm NGRAM``: drafts from the sequence's own tokens.
    drafter: NgramDrafter | None = None

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.spec.prompt_ids

    @property
    def generated(self) -> list[int]:
        return self.row.generated

    def tokens_in_cache(self) -> tuple[int, ...]:
        """The ids whose KV this slot holds, in order."""
        all_ids = self.prompt + tuple(self.generated)
        return all_ids[: self.kv_len]

    def take(self, token: int, *, context_length: int) -> Finish | None:
        """Append a sampled token, advance the grammar (if any) over it, and say whether
        the sequence ends there (``finish.finish_after``)."""
        self.generated.append(token)
        matcher = self.row.matcher
        verdict = None
        if matcher is not None:
            accepted = matcher.consume(token)
            verdict = GrammarVerdict(accepted, matcher.stopped, matcher.error)
        return finish_after(
            token,
            generated=len(self.generated),
            params=self.row.params,
            stop_ids=self.row.stop_ids,
            prompt_len=len(self.prompt),
            context_length=context_length,
            grammar=verdict,
        )

    def draft(self, context_length: int) -> list[int]:
        """The tokens this sequence is expected to go on with (none without
        speculation), no more than it may still generate or its context still holds."""
        if self.drafter is None:
            return []
        self.drafter.sync(self.generated)
        room = min(
            self.row.params.max_tokens - len(self.generated) - 1,
            context_length - 1 - self.kv_len,
        )
        return self.drafter.propose(room)

    def next_seq(self) -> int:
        self.seq_no += 1
        return self.seq_no - 1

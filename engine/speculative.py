"""N-gram speculative decoding: drafts from the sequence's own tokens, no draft model.

A sequence that ends in tokens it has seen before (a quoted prompt, repeated JSON
keys, code that restates a name) probably goes on as it went on then. ``NgramDrafter``
finds the earlier occurrence of the sequence's last tokens that matches longest (at
least ``min_window`` tokens, compared up to ``max_window``; the most recent on ties)
and proposes the tokens that followed it, as SGLang's ``NGRAM`` and vLLM's ``ngram``
(prompt lookup) methods do.

The scheduler verifies a draft in one forward over the last token and the draft, and
samples each position with the sequence's own sampling, exactly as a plain step
would; a draft token is kept while it equals the token sampled at its position. For
a draft that is one fixed token this is speculative sampling's rule itself (accept
with probability p(draft); on a rejection the sampled token is distributed as p
without the draft), so greedy outputs are the plain greedy outputs and sampled ones
keep their distribution: a seeded request draws its random numbers in the same order
and gives the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

NGRAM = "NGRAM"
ALGORITHMS = (NGRAM,)

# Of the earlier occurrences of the last ``min_window`` tokens, how many of the most
# recent are compared further back: a bound on the work per step, whatever the length.
_CANDIDATES = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-algorithm NGRAM`` and its sizes."""

    num_draft_tokens: int = 8
    min_window: int = 1
    max_window: int = 12

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError("--speculative-num-draft-tokens must be at least 1")
        if not 1 <= self.min_window <= self.max_window:
            raise ValueError(
                "the n-gram match windows need 1 <= --speculative-ngram-min-match-window-size "
                "<= --speculative-ngram-max-match-window-size"
            )


class NgramDrafter:
    """One sequence's tokens, indexed by every ``min_window``-gram they contain."""

    def __init__(self, config: SpeculativeConfig, prompt: Sequence[int]) -> None:
        self.config = config
        self.tokens: list[int] = []
        # gram -> the positions that followed it, oldest first. The gram ending at the
        # last token is indexed only once its follower arrives, so the sequence's own
        # suffix is never its match.
        self._followers: dict[tuple[int, ...], list[int]] = {}
        self._prompt_len = len(prompt)
        # How long the next draft may be: a draft costs a forward position per token
        # whether it is kept or not, so the length follows how the last one fared.
        self.length = config.num_draft_tokens
        self.extend(prompt)

    def extend(self, tokens: Sequence[int]) -> None:
        n = self.config.min_window
        for token in tokens:
            at = len(self.tokens)
            if at >= n:
                self._followers.setdefault(tuple(self.tokens[at - n : at]), []).append(at)
            self.tokens.append(token)

    def sync(self, generated: Sequence[int]) -> None:
        """Take in the tokens generated since the last call."""
        self.extend(generated[len(self.tokens) - self._prompt_len :])

    def propose(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the best earlier match of the sequence's
        end; none if its last ``min_window`` tokens never occurred before."""
        tokens, config = self.tokens, self.config
        end = len(tokens)
        n = config.min_window
        if limit < 1 or end <= n:
            return []
        followers = self._followers.get(tuple(tokens[end - n :]))
        if not followers:
            return []
        best_at, best_len = -1, 0
        for at in reversed(followers[-_CANDIDATES:]):
            length = n
            while (
                length < config.max_window
                and at - length - 1 >= 0
                and tokens[at - length - 1] == tokens[end - length - 1]
            ):
                length += 1
            if length > best_len:
                best_at, best_len = at, length
                if length == config.max_window:
                    break
        return tokens[best_at : best_at + min(limit, self.length)]

    def settle(self, drafted: int, kept: int) -> None:
        """After a draft's verification: a draft kept whole doubles the next one's
        length (up to ``num_draft_tokens``), one cut short makes it what was kept plus one."""
        if drafted == 0:
            return
        if kept == drafted:
            self.length = min(self.length * 2, self.config.num_draft_tokens)
        else:
            self.length = kept + 1


def verify(
    drafts: Sequence[Sequence[int]], sample: Callable[[list[int], list[int]], list[int | None]]
) -> list[int]:
    """How many tokens of each row's draft are kept.

    Row ``i`` ran its last token and ``drafts[i]``; ``sample(rows, at)`` samples rows
    ``rows`` at logit rows ``at`` (a row per position, rows in order) and returns each
    one's token, or None where the row finished. Positions are sampled in order, and a
    row goes on to the next while the token sampled at this one is its draft's."""
    lengths = [1 + len(draft) for draft in drafts]
    offsets = [0]
    for n in lengths[:-1]:
        offsets.append(offsets[-1] + n)
    kept = [0] * len(drafts)
    active = list(range(len(drafts)))
    for position in range(max(lengths, default=0)):
        tokens = sample(active, [offsets[i] + position for i in active])
        active = [
            i
            for i, token in zip(active, tokens, strict=True)
            if token is not None and position < len(drafts[i]) and token == drafts[i][position]
        ]
        if not active:
            break
        for i in active:
            kept[i] += 1
    return kept

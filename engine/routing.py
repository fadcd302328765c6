"""Which engine worker a request goes to (``--dp-size``): least load, with prefix
affinity.

Load is vLLM's ``waiting × 4 + running``. A request goes to the worker that holds its
longest cached prefix (the prompts it was sent recently stand in for its cache) when
that prefix is at least half the prompt (SMG's ``cache_threshold``: a shared chat
template header alone must not herd every request onto one worker) and the loads are
not imbalanced (SMG's guard: ``max − min > 64`` and ``max > 1.5 × min``); otherwise to
the least loaded. Every choice of one
request goes to one worker (its choices share the prompt, and ``n`` shares the prefill).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .sequence import common_prefix_len

IMBALANCE_ABS = 64
IMBALANCE_REL = 1.5
CACHE_THRESHOLD = 0.5
HISTORY = 256  # prompts remembered per worker (its slots hold about as many)


@dataclass(frozen=True, slots=True)
class Load:
    running: int
    waiting: int

    @property
    def score(self) -> int:
        return self.waiting * 4 + self.running


def imbalanced(scores: Sequence[int]) -> bool:
    high, low = max(scores), min(scores)
    return high - low > IMBALANCE_ABS and high > IMBALANCE_REL * low


class PrefixAffinityRouter:
    def __init__(self, ranks: int, *, affinity: bool = True, history: int = HISTORY) -> None:
        self.affinity = affinity
        self._recent: list[deque[tuple[int, ...]]] = [deque(maxlen=history) for _ in range(ranks)]

    def choose(self, prompt: tuple[int, ...], loads: Mapping[int, Load]) -> int:
        """A rank among ``loads``' (the workers that are up); lowest rank on ties."""
        if not loads:
            raise ValueError("no engine worker is up")
        scores = {rank: load.score for rank, load in loads.items()}
        least = min(scores, key=lambda rank: (scores[rank], rank))
        if not self.affinity or imbalanced(list(scores.values())):
            return least
        matched = {rank: self.cached_prefix(rank, prompt) for rank in scores}
        best = max(matched.values())
        if best == 0 or best < CACHE_THRESHOLD * len(prompt):
            return least
        return min((r for r in scores if matched[r] == best), key=lambda r: (scores[r], r))

    def cached_prefix(self, rank: int, prompt: tuple[int, ...]) -> int:
        """The longest prefix of ``prompt`` that a prompt recently sent to ``rank`` shares."""
        return max((common_prefix_len(prompt, seen) for seen in self._recent[rank]), default=0)

    def sent(self, rank: int, prompt: tuple[int, ...]) -> None:
        self._recent[rank].append(prompt)

    def forget(self, rank: int) -> None:
        """The worker restarted: its cache is empty."""
        self._recent[rank].clear()

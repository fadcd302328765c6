"""Which engine worker a request goes to (``--dp-size``): cache-aware, as SGLang's
model gateway (SMG) routes, with its thresholds' names.

A request has a target: the worker its ``routing_key`` (the client's
``prompt_cache_key``, else its ``user``) last went to, or else the worker holding its
longest cached prefix (the prompts it was sent recently stand in for its cache) when
that prefix is at least ``cache_threshold`` of the prompt, so that a shared template
header alone does not herd every request onto one worker. It goes to its target unless
the target is overloaded: more than ``balance_abs_threshold`` sequences in flight
beyond the least busy worker *and* more than ``balance_rel_threshold`` times its
count (SMG's guard). Otherwise, and without a target, it goes to the least loaded
worker by vLLM's ``waiting × 4 + running``. A keyed request's worker becomes its key's
target. Every choice of one request goes to one worker (its choices share the prompt,
and ``n`` shares the prefill).

SMG's own default absolute threshold (64) suits GPU workers that run hundreds of
sequences; a CPU worker runs tens, and with it a burst of 16 chat requests sharing a
system prompt all went to one of two workers. The default here is a few sequences.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass

from sluice.engine.sequence import common_prefix_len

HISTORY = 256  # prompts remembered per worker (its slots hold about as many)
KEYS = 4096  # routing keys remembered, least recently used forgotten first


@dataclass(frozen=True, slots=True)
class Balance:
    """SMG's cache-aware thresholds (``--balance-abs-threshold``,
    ``--balance-rel-threshold``, ``--cache-threshold``)."""

    abs_threshold: int = 4
    rel_threshold: float = 1.5
    cache_threshold: float = 0.5


@dataclass(frozen=True, slots=True)
class Load:
    running: int
    waiting: int

    @property
    def score(self) -> int:
        return self.waiting * 4 + self.running

    @property
    def in_flight(self) -> int:
        return self.running + self.waiting


class CacheAwareRouter:
    def __init__(
        self,
        ranks: int,
        *,
        affinity: bool = True,
        balance: Balance | None = None,
        history: int = HISTORY,
    ) -> None:
        self.affinity = affinity
        self.balance = balance or Balance()
        self._recent: list[deque[tuple[int, ...]]] = [deque(maxlen=history) for _ in range(ranks)]
        self._homes: OrderedDict[str, int] = OrderedDict()

    def choose(
        self, prompt: tuple[int, ...], loads: Mapping[int, Load], key: str | None = None
    ) -> int:
        """A rank among ``loads``' (the workers that are up); lowest rank on ties."""
        if not loads:
            raise ValueError("no engine worker is up")
        least = min(loads, key=lambda rank: (loads[rank].score, rank))
        if not self.affinity:
            return least
        target = self._target(prompt, loads, key)
        chosen = least if target is None or self.overloaded(target, loads) else target
        if key is not None:
            self._homes[key] = chosen
            self._homes.move_to_end(key)
            while len(self._homes) > KEYS:
                self._homes.popitem(last=False)
        return chosen

    def overloaded(self, rank: int, loads: Mapping[int, Load]) -> bool:
        low = min(load.in_flight for load in loads.values())
        high = loads[rank].in_flight
        return high - low > self.balance.abs_threshold and high > self.balance.rel_threshold * low

    def _target(
        self, prompt: tuple[int, ...], loads: Mapping[int, Load], key: str | None
    ) -> int | None:
        home = self._homes.get(key) if key is not None else None
        if home is not None and home in loads:
            return home
        matched = {rank: self.cached_prefix(rank, prompt) for rank in loads}
        best = max(matched.values())
        if best == 0 or best < self.balance.cache_threshold * len(prompt):
            return None
        return min((r for r in loads if matched[r] == best), key=lambda r: (loads[r].score, r))

    def cached_prefix(self, rank: int, prompt: tuple[int, ...]) -> int:
        """The longest prefix of ``prompt`` that a prompt recently sent to ``rank`` shares."""
        return max((common_prefix_len(prompt, seen) for seen in self._recent[rank]), default=0)

    def sent(self, rank: int, prompt: tuple[int, ...]) -> None:
        self._recent[rank].append(prompt)

    def forget(self, rank: int) -> None:
        """The worker restarted or flushed: its cache is empty, its keys go elsewhere."""
        self._recent[rank].clear()
        for key in [k for k, home in self._homes.items() if home == rank]:
            del self._homes[key]

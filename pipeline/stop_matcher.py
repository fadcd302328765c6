"""OpenAI ``stop`` strings matched on streamed text.

Text reaches the client only once it can no longer turn out to be part of a stop string,
so a stop split across tokens never leaks. The outcome does not depend on how the text is
chunked: it is always the match that starts earliest in the whole text, the longest one
at that position. That means a complete match is held (not reported) while an earlier or
longer stop could still complete, e.g. "ab" with stops ("ab", "abc") until the next char.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True, slots=True)
class StopResult:
    """Text that may be released now, and the stop string once one has matched."""

    text: str
    matched: str | None = None


_NOTHING = StopResult("")


class StopMatcher:
    """Finds the first of several stop strings in text fed chunk by chunk."""

    __slots__ = (
        "_done",
        "_first_char",
        "_held",
        "_matched",
        "_no_stop_trim",
        "_prefixes",
        "_stop",
        "_window",
        "holds_back",
    )

    def __init__(self, stops: Sequence[str], *, no_stop_trim: bool = False) -> None:
        unique = sorted({s for s in stops if s}, key=len, reverse=True)
        # False when there is nothing to match: ``feed`` then returns its input unchanged,
        # and callers may skip the matcher altogether.
        self.holds_back: Final = bool(unique)
        self._no_stop_trim = no_stop_trim
        # A regex finds the leftmost match in one C call; listing the longest stops first
        # makes it prefer the longest of those starting at that position.
        self._stop = _any_of(map(re.escape, unique))
        self._prefixes = frozenset(s[:i] for s in unique for i in range(1, len(s)))
        self._first_char = _any_of(map(re.escape, {p[0] for p in self._prefixes}))
        self._window = max(map(len, unique), default=1) - 1
        self._held = ""
        self._matched: str | None = None
        self._done = False

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, once ``feed`` or ``flush`` found one."""
        return self._matched

    def feed(self, text: str) -> StopResult:
        """Add streamed text; return what can be released and the match, if any."""
        if not self.holds_back:
            return StopResult(text)
        if self._done:
            return _NOTHING
        buf = self._held + text
        match = self._stop.search(buf)
        hold = self._hold_start(buf)
        if match is not None and match.start() < hold:
            stop = match[0]
            return StopResult(self._finish(buf, match.start(), stop), stop)
        self._held = buf[hold:]
        return StopResult(buf[:hold]) if hold else _NOTHING

    def flush(self) -> str:
        """At the end of generation: release the held text, cut at a match still held.

        Such a match (e.g. "ab" while "abc" was possible) is then reported by ``matched``.
        """
        if self._done:
            return ""
        buf, self._held = self._held, ""
        match = self._stop.search(buf)
        if match is not None:
            return self._finish(buf, match.start(), match[0])
        self._done = True
        return buf

    def _hold_start(self, buf: str) -> int:
        """Start of the longest suffix of ``buf`` that a stop string could still complete."""
        end = len(buf)
        # Usually no char of the tail can start a stop: one C call settles it.
        candidate = self._first_char.search(buf, max(0, end - self._window))
        while candidate is not None:
            i = candidate.start()
            if buf[i:] in self._prefixes:
                return i
            candidate = self._first_char.search(buf, i + 1)
        return end

    def _finish(self, buf: str, pos: int, stop: str) -> str:
        self._done = True
        self._held = ""
        self._matched = stop
        return buf[: pos + len(stop)] if self._no_stop_trim else buf[:pos]


def _any_of(patterns: Iterable[str]) -> re.Pattern[str]:
    """Alternation of ``patterns`` in order; with none, a regex that never matches."""
    return re.compile("|".join(patterns) or "(?!)")

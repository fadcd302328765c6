"""Where a tool call's bracketed value ends, found incrementally as text streams in
(``JsonScan`` for JSON, ``PyScan`` for a Python list), and the value read once it has.

A scanner resumes where the last feed stopped, so a long call costs one pass however
it is chunked. ``NeedMore``: the text so far is a valid beginning; ``NotACall``: it
cannot be one.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar


class NeedMore(Exception):
    """The text so far is a valid beginning: wait for more."""


class NotACall(Exception):
    """The text cannot be (or complete) a call: it is content."""


def _refuse_constant(name: str) -> object:
    raise ValueError(name)  # NaN and Infinity are not JSON


def loads(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise NotACall from exc


class Scanner(ABC):
    """Finds where a bracketed value ends, resuming where the last feed stopped."""

    __slots__ = ("_done", "_pos")

    def __init__(self, pos: int) -> None:
        self._pos = pos
        self._done: int | None = None

    def end(self, buf: str) -> int:
        if self._done is None:
            self._done = self._advance(buf)
            if self._done is None:
                raise NeedMore
        return self._done

    @abstractmethod
    def _advance(self, buf: str) -> int | None:
        """Scan on to the end of ``buf``: the value's end, None if not there yet."""


_TOP, _VALUE, _ARR0, _OBJ0, _KEY, _COLON, _AFTER, _STR, _ESC, _HEX, _BARE = range(11)
_STR_STOP = re.compile(r'["\\\x00-\x1f]')
_BARE_RUN = re.compile(r"[-+.\w]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_CLOSE = {"{": "}", "[": "]"}


class JsonScan(Scanner):
    """A JSON syntax automaton: the value's end, or ``NotACall`` at the first wrong char.

    Only the end is found here; ``json.loads`` builds the value in one C call.
    """

    __slots__ = ("_hex", "_key", "_mark", "_opener", "_stack", "_state")

    def __init__(self, pos: int, opener: str) -> None:
        super().__init__(pos)
        self._opener = opener
        self._stack: list[str] = []
        self._state = _TOP
        self._key = False
        self._mark = 0
        self._hex = 0

    def _advance(self, buf: str) -> int | None:
        i, n, st, stack = self._pos, len(buf), self._state, self._stack
        while i < n:
            c = buf[i]
            if st == _STR:
                m = _STR_STOP.search(buf, i)
                if m is None:
                    i = n
                    break
                i = m.end()
                if m[0] == "\\":
                    st = _ESC
                    continue
                if m[0] != '"':
                    raise NotACall
                if self._key:
                    st = _COLON
                    continue
            elif st == _ESC:
                if c == "u":
                    st, self._hex = _HEX, 4
                elif c in '"\\/bfnrt':
                    st = _STR
                else:
                    raise NotACall
                i += 1
                continue
            elif st == _HEX:
                if c not in "0123456789abcdefABCDEF":
                    raise NotACall
                self._hex -= 1
                st = _HEX if self._hex else _STR
                i += 1
                continue
            elif st == _BARE:
                m = _BARE_RUN.match(buf, i)
                assert m is not None
                i = m.end()
                if i == n:
                    break  # the number or literal may go on
                token = buf[self._mark : i]
                if token not in ("true", "false", "null") and not _NUMBER.fullmatch(token):
                    raise NotACall
            elif c in " \t\n\r":
                i += 1
                continue
            elif st == _TOP:
                if c != self._opener:
                    raise NotACall
                stack.append(c)
                st = _OBJ0 if c == "{" else _ARR0
                i += 1
                continue
            elif st == _COLON:
                if c != ":":
                    raise NotACall
                st = _VALUE
                i += 1
                continue
            elif st in (_OBJ0, _KEY):
                if c == '"':
                    st, self._key = _STR, True
                    i += 1
                    continue
                if c != "}" or st == _KEY:
                    raise NotACall
                stack.pop()
                i += 1
            elif st == _AFTER:
                if c == ",":
                    st = _KEY if stack[-1] == "{" else _VALUE
                    i += 1
                    continue
                if c != _CLOSE[stack[-1]]:
                    raise NotACall
                stack.pop()
                i += 1
            elif c == "]" and st == _ARR0:
                stack.pop()
                i += 1
            elif c in "{[":
                stack.append(c)
                st = _OBJ0 if c == "{" else _ARR0
                i += 1
                continue
            elif c == '"':
                st, self._key = _STR, False
                i += 1
                continue
            elif c in "-0123456789tfn":
                st, self._mark = _BARE, i
                continue
            else:
                raise NotACall
            # A value ended at i.
            if not stack:
                return i
            st = _AFTER
        self._pos, self._state = i, st
        return None


class PyScan(Scanner):
    """Finds the ``]`` closing a Python list, skipping strings and nested brackets."""

    __slots__ = ("_depth", "_quote")

    _STOP: ClassVar[dict[str, re.Pattern[str]]] = {
        "'": re.compile(r"[\\']"),
        '"': re.compile(r'[\\"]'),
    }

    def __init__(self, pos: int) -> None:
        super().__init__(pos)
        self._depth = 0
        self._quote = ""

    def _advance(self, buf: str) -> int | None:
        i, n = self._pos, len(buf)
        while i < n:
            quote = self._quote
            if quote:
                m = self._STOP[quote[0]].search(buf, i)
                if m is None:
                    i = n
                elif m[0] == "\\":
                    if m.start() + 2 > n:
                        i = m.start()
                        break
                    i = m.start() + 2
                elif len(quote) == 3 and not buf.startswith(quote, m.start()):
                    if m.start() + 3 > n:
                        i = m.start()
                        break
                    i = m.end()
                else:
                    i, self._quote = m.start() + len(quote), ""
                continue
            c = buf[i]
            if c in "'\"":
                if i + 3 > n:
                    break  # may open a triple-quoted string
                self._quote = c * 3 if buf.startswith(c * 3, i) else c
                i += len(self._quote)
                continue
            i += 1
            if c in "([{":
                self._depth += 1
            elif c in ")]}":
                self._depth -= 1
                if not self._depth:
                    if c != "]":
                        raise NotACall
                    return i
        self._pos = i
        return None

"""Tool-call parsers: find a model's tool calls in its streamed text (the formats
themselves: ``tool_formats``).

Each model family writes calls in its own format (``--tool-call-parser NAME``). A parser
is fed a choice's content text as it is decoded and returns events: ``ContentText``
for text that is not a call, then for each call ``ToolCallStart(index, name)`` and
``ToolCallArgs(index, fragment)``; parallel calls get indexes 0, 1, … in order.

The contract, the same however the text is chunked:

* Text is held back only while it could still be the start of a call (or is trailing
  whitespace, see below); content before a call is released as soon as it cannot be.
* A call is emitted once it is complete and valid (its closing marker, or the end of
  its JSON / Python list, has arrived), as its name and then its arguments in ONE
  fragment. Holding the call until then is what lets a malformed or truncated call
  come out as the text it was, never as a half-call and never as an exception; the
  price is that a call's arguments are not streamed piece by piece.
* The arguments are the JSON object re-serialised as SGLang does it
  (``json.dumps(args, ensure_ascii=False)``): always a JSON object, whatever the model
  wrote (a Python literal, XML parameters, a JSON string holding an object).
* Whitespace right before a call, and after the last call at the end of the output,
  is dropped (SGLang strips it in its non-streamed parse); all other content is passed
  through verbatim, and a call that does not parse is passed through with its markers.
* Sections: a call inside a section (DeepSeek, Kimi) or after ``;`` (Llama 3) is
  parsed call by call; a section's begin and end markers are dropped.

``tools`` (function name → its ``parameters`` JSON Schema) is optional: with it, a
call to a function not in it is treated as malformed text, and the XML formats
(``glm45``, ``qwen3_coder``) type each parameter by its schema. Without it, an XML
value is JSON if it parses as JSON, else a string.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from sluice.pipeline.reasoning import partial_marker_len

from .tool_scanners import JsonScan, NeedMore, NotACall, Scanner, loads


@dataclass(frozen=True, slots=True)
class ContentText:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgs:
    index: int
    fragment: str


ToolEvent = ContentText | ToolCallStart | ToolCallArgs
Schemas = Mapping[str, Mapping[str, Any]]
"""Function name → the JSON Schema of its parameters, as in the request's ``tools``."""


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # serialised JSON object


@dataclass(frozen=True, slots=True)
class CallUnit:
    """The buffer's first ``end`` chars are complete calls."""

    end: int
    calls: tuple[ParsedCall, ...]
    # More calls may follow without an opener (a section, ``;``-separated JSON, …):
    # the next step is ``_next_in_section``.
    section: bool = False


@dataclass(frozen=True, slots=True)
class _Text:
    """The buffer's first ``n`` chars are content."""

    n: int


@dataclass(frozen=True, slots=True)
class SectionExit:
    """The section is over; its first ``n`` chars (an end marker) are dropped."""

    n: int


_Step = CallUnit | _Text | SectionExit


class ToolParser(ABC):
    """Splits one choice's streamed content into text and tool calls (one per choice)."""

    openers: ClassVar[tuple[str, ...]] = ()
    """Markers that start a call anywhere in the text."""
    start_openers: ClassVar[tuple[str, ...]] = ()
    """Markers that start a call only as the output's first non-whitespace text."""
    _opener_re: ClassVar[re.Pattern[str]]

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        longest_first = sorted(cls.openers, key=len, reverse=True)
        cls._opener_re = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")

    def __init__(self, tools: Schemas | None = None) -> None:
        self._tools = tools
        self._buf = ""
        self._section = False
        self._started = False  # anything but whitespace seen: start openers are off
        self._ws = ""  # content's trailing whitespace, held: dropped if a call follows
        self._last_call = False  # the last thing released was a call
        self._count = 0
        self._scans: dict[int, Scanner] = {}  # by position in ``_buf``
        self._out: list[ToolEvent] = []

    def feed(self, text: str) -> list[ToolEvent]:
        """Add decoded content text; return the events that can be released now."""
        self._buf += text
        self._drain(final=False)
        return self._take()

    def finish(self) -> list[ToolEvent]:
        """At the end of the output: release the rest, an unfinished call as text."""
        self._drain(final=True)
        if not self._last_call:
            self._emit_text(self._ws)
        self._ws = ""
        return self._take()

    @abstractmethod
    def _unit(self, buf: str) -> CallUnit:
        """Parse the call(s) that ``buf`` starts with (it starts with an opener).

        Raises ``NeedMore`` while the text is a valid beginning, ``NotACall`` once it is not.
        """

    def _next_in_section(self, buf: str) -> CallUnit | SectionExit:
        """After a unit with ``section=True``: the next call, or the section's end."""
        return SectionExit(0)

    def _drain(self, *, final: bool) -> None:
        while self._buf and self._apply(self._step(self._buf, final)):
            pass

    def _step(self, buf: str, final: bool) -> _Step | None:
        """What the buffer starts with; None while that is not known yet."""
        if self._section:
            return self._attempt(self._next_in_section, buf, final, SectionExit(0))
        if not self._started:
            if lead := len(buf) - len(buf.lstrip()):
                return _Text(lead)
            op = next((o for o in self.start_openers if buf.startswith(o)), None)
            if op is not None:
                return self._attempt(self._unit, buf, final, _Text(len(op)))
            self._started = True
        match = self._opener_re.search(buf)
        if match is None:
            cut = len(buf) - (0 if final else partial_marker_len(buf, self.openers))
            return _Text(cut) if cut else None
        if match.start():
            return _Text(match.start())
        return self._attempt(self._unit, buf, final, _Text(match.end()))

    @staticmethod
    def _attempt(
        parse: Callable[[str], _Step], buf: str, final: bool, otherwise: _Step
    ) -> _Step | None:
        try:
            return parse(buf)
        except NeedMore:
            return otherwise if final else None
        except NotACall:
            return otherwise

    def _apply(self, step: _Step | None) -> bool:
        """Act on a parse step; False when more text is needed."""
        if step is None:
            return False
        if isinstance(step, _Text):
            self._content(self._buf[: step.n])
            self._consume(step.n)
        elif isinstance(step, SectionExit):
            self._section = False
            self._consume(step.n)
        else:
            self._consume(step.end)
            self._section = step.section
            self._ws, self._last_call, self._started = "", True, True
            for call in step.calls:
                self._out += (
                    ToolCallStart(self._count, call.name),
                    ToolCallArgs(self._count, call.arguments),
                )
                self._count += 1
        return True

    def _consume(self, n: int) -> None:
        self._buf = self._buf[n:]
        self._scans.clear()  # their positions have moved

    def _content(self, text: str) -> None:
        """Release content, holding its trailing whitespace until it is known to stay."""
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body) :]
        if body:
            self._last_call, self._started = False, True
            self._emit_text(body)

    def _emit_text(self, text: str) -> None:
        if not text:
            return
        if self._out and isinstance(last := self._out[-1], ContentText):
            self._out[-1] = ContentText(last.text + text)
        else:
            self._out.append(ContentText(text))

    def _take(self) -> list[ToolEvent]:
        out, self._out = self._out, []
        return out

    # ---------------------------------------------------------------- unit helpers

    def _json(self, buf: str, pos: int, opener: str = "{") -> tuple[Any, int]:
        """The JSON object (or array, ``opener="["``) at ``pos`` and where it ends."""
        end = self._scan(buf, pos, lambda: JsonScan(pos, opener))
        return loads(buf[pos:end]), end

    def _scan(self, buf: str, pos: int, make: Callable[[], Scanner]) -> int:
        """End of the bracketed value at ``pos``, scanned incrementally across feeds."""
        scan = self._scans.get(pos)
        if scan is None:
            scan = self._scans[pos] = make()
        return scan.end(buf)

    def _call(self, name: object, arguments: object) -> ParsedCall:
        if isinstance(arguments, str):
            arguments = loads(arguments)
        if not isinstance(name, str) or not _CALL_NAME.fullmatch(name):
            raise NotACall
        if not isinstance(arguments, dict):
            raise NotACall
        if self._tools is not None and name not in self._tools:
            raise NotACall
        try:
            text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
            text.encode()  # a lone surrogate from a \ud800 escape cannot be sent
        except (TypeError, ValueError, RecursionError) as exc:
            raise NotACall from exc
        return ParsedCall(name, text)

    def _call_from(self, obj: object, *, need_arguments: bool = False) -> ParsedCall:
        """A call from ``{"name": …, "arguments" | "parameters": {…}}``."""
        if not isinstance(obj, dict):
            raise NotACall
        for key in ("arguments", "parameters"):
            if key in obj:
                return self._call(obj.get("name"), obj[key])
        if need_arguments:
            raise NotACall
        return self._call(obj.get("name"), {})

    def _xml_value(self, function: str, key: str, raw: str) -> object:
        """A parameter written as bare text, typed by the function's schema."""
        schema = (self._tools or {}).get(function) or {}
        properties = schema.get("properties")
        types = _schema_types(properties.get(key) if isinstance(properties, Mapping) else None)
        if types and types <= {"string"}:
            return raw
        try:
            return loads(raw)
        except NotACall:
            return raw


# -------------------------------------------------------------------- text helpers

_WS = re.compile(r"\s*")
# Function names as models write them: OpenAI's [a-zA-Z0-9_-] plus dots and colons for
# namespaced tools. Anything else (a stray JSON document, a sentence) is not a call.
_CALL_NAME = re.compile(r"[\w.:\-]+")


def skip_ws(buf: str, pos: int) -> int:
    m = _WS.match(buf, pos)
    assert m is not None  # \s* always matches
    return m.end()


def find_marker(buf: str, pos: int, *markers: str) -> tuple[int, int]:
    """Which marker starts at ``pos``, and the position after it."""
    rest = buf[pos:]
    for i, marker in enumerate(markers):
        if rest.startswith(marker):
            return i, pos + len(marker)
    if any(marker.startswith(rest) for marker in markers):
        raise NeedMore
    raise NotACall


def expect_marker(buf: str, pos: int, marker: str) -> int:
    return find_marker(buf, pos, marker)[1]


def read_until(buf: str, pos: int, marker: str, forbid: str = "") -> tuple[str, int]:
    """The text from ``pos`` to ``marker``, none of ``forbid`` in it; after the marker."""
    i = buf.find(marker, pos)
    text = buf[pos:] if i < 0 else buf[pos:i]
    if i < 0:
        text = text[: len(text) - partial_marker_len(text, (marker,))]
    if any(c in text for c in forbid):
        raise NotACall
    if i < 0:
        raise NeedMore
    return text, i + len(marker)


def _schema_types(schema: object) -> set[str]:
    if not isinstance(schema, Mapping):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return {
        t for key in ("anyOf", "oneOf") for s in schema.get(key) or () for t in _schema_types(s)
    }

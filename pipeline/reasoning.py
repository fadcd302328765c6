"""Reasoning parsers: split a choice's streamed text into reasoning and content.

A reasoning model writes its thinking between two markers (``<think>…</think>`` and
kin), then the answer. The parser is fed the text as it is decoded and returns
``(channel, text)`` pieces. Text is held back only while it could still be the start
of a marker, so a marker split across chunks never leaks; and the pieces join to the
same two strings however the text was chunked. Whitespace is normalised as SGLang's
non-streamed parse does it (and its streamed one does not): the reasoning is stripped
at both ends, the content's leading whitespace after the end marker is dropped, and so
is whitespace before a start marker at the very beginning of the output.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Channel = Literal["reasoning", "content"]
Piece = tuple[Channel, str]


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """The markers of one model family's reasoning block."""

    start: str
    end: str
    # The output begins inside the block: the chat template already wrote the start
    # marker (DeepSeek-R1), so a start marker in the output is optional.
    forced: bool = False
    # A tool-call marker that also ends an unclosed block (SGLang's Qwen3 behaviour: a
    # model may start calling a tool without closing its thinking). It stays content.
    interrupt: str | None = None


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat("<think>", "</think>", forced=True),
    "qwen3": ReasoningFormat("<think>", "</think>", interrupt="<tool_call>"),
    "kimi": ReasoningFormat("◁think▷", "◁/think▷"),
    "mistral": ReasoningFormat("[THINK]", "[/THINK]"),
}

_BEFORE, _THINK, _AFTER = range(3)


def partial_marker_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


class ReasoningParser:
    """Streams one choice's text into reasoning and content pieces.

    ``stream_reasoning=False`` holds the reasoning until its block ends and releases it
    in one piece (SGLang's option of that name). ``enable_thinking=False`` turns the
    parser into a pass-through, for a request that disabled thinking in its template.
    ``force_reasoning`` overrides whether the output begins inside the block.
    """

    __slots__ = (
        "_buf",
        "_fmt",
        "_fresh",
        "_lstrip",
        "_opening",
        "_out",
        "_state",
        "_stream",
        "_unsent",
        "_ws",
    )

    def __init__(
        self,
        fmt: ReasoningFormat,
        *,
        stream_reasoning: bool = True,
        enable_thinking: bool = True,
        force_reasoning: bool | None = None,
    ) -> None:
        self._fmt = fmt
        self._stream = stream_reasoning
        forced = fmt.forced if force_reasoning is None else force_reasoning
        self._state = _AFTER if not enable_thinking else _THINK if forced else _BEFORE
        self._buf = ""
        self._fresh = True  # no content released yet
        self._opening = forced  # in the block, before its first non-whitespace
        self._lstrip = False  # drop the content's leading whitespace
        self._ws = ""  # reasoning's trailing whitespace, held: it may end the block
        self._unsent = ""  # reasoning held by stream_reasoning=False
        self._out: list[Piece] = []

    @property
    def thinking(self) -> bool:
        """Inside the reasoning block (text fed now would be reasoning)."""
        return self._state == _THINK

    def feed(self, text: str) -> list[Piece]:
        """Add decoded text; return the pieces that can be released now."""
        self._buf += text
        self._drain(final=False)
        return self._take()

    def finish(self) -> list[Piece]:
        """At the end of the output: release everything, a truncated block as reasoning."""
        self._drain(final=True)
        self._reasoning("", closed=True)
        return self._take()

    def _drain(self, *, final: bool) -> None:
        fmt = self._fmt
        while self._buf:
            buf = self._buf
            if self._state == _AFTER:
                self._content(buf.lstrip() if self._lstrip else buf)
                self._buf = ""
            elif self._state == _BEFORE:
                i = buf.find(fmt.start)
                if i >= 0:
                    if not (self._fresh and buf[:i].isspace()):
                        self._content(buf[:i])
                    self._buf = buf[i + len(fmt.start) :]
                    self._state, self._opening = _THINK, True
                    continue
                cut = len(buf) - (0 if final else partial_marker_len(buf, (fmt.start,)))
                if self._fresh and not final and buf[:cut].isspace():
                    cut = 0  # leading whitespace: dropped if a block follows
                self._content(buf[:cut])
                self._buf = buf[cut:]
                break
            elif self._opening:
                buf = self._buf = buf.lstrip()
                if buf.startswith(fmt.start):
                    self._buf = buf[len(fmt.start) :]
                elif buf and (final or not fmt.start.startswith(buf)):
                    self._opening = False
                else:
                    break
            else:
                markers = (fmt.end,) if fmt.interrupt is None else (fmt.end, fmt.interrupt)
                hits = [(i, m) for m in markers if (i := buf.find(m)) >= 0]
                if hits:
                    i, marker = min(hits)
                    self._reasoning(buf[:i], closed=True)
                    # The end marker is consumed; an interrupting tool marker is content.
                    self._buf = buf[i + len(marker) :] if marker == fmt.end else buf[i:]
                    self._state, self._lstrip = _AFTER, marker == fmt.end
                    continue
                cut = len(buf) - (0 if final else partial_marker_len(buf, markers))
                self._reasoning(buf[:cut], closed=False)
                self._buf = buf[cut:]
                break

    def _content(self, text: str) -> None:
        if text:
            self._lstrip = self._fresh = False
            self._emit("content", text)

    def _reasoning(self, text: str, *, closed: bool) -> None:
        text = self._ws + text
        body = text.rstrip()
        self._ws = "" if closed else text[len(body) :]
        if self._stream:
            self._emit("reasoning", body)
        else:
            self._unsent += body
            if closed:
                self._emit("reasoning", self._unsent)
                self._unsent = ""

    def _emit(self, channel: Channel, text: str) -> None:
        if not text:
            return
        if self._out and self._out[-1][0] == channel:
            self._out[-1] = (channel, self._out[-1][1] + text)
        else:
            self._out.append((channel, text))

    def _take(self) -> list[Piece]:
        out, self._out = self._out, []
        return out


def make_reasoning_parser(
    name: str,
    *,
    stream_reasoning: bool = True,
    enable_thinking: bool = True,
    force_reasoning: bool | None = None,
) -> ReasoningParser:
    """A fresh parser (one per choice) for ``--reasoning-parser NAME``."""
    fmt = REASONING_FORMATS.get(name)
    if fmt is None:
        names = ", ".join(sorted(REASONING_FORMATS))
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of: {names}")
    return ReasoningParser(
        fmt,
        stream_reasoning=stream_reasoning,
        enable_thinking=enable_thinking,
        force_reasoning=force_reasoning,
    )

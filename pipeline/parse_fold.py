"""The parse-fold stage: where reasoning and tool-call parsers split a choice's text
into content, reasoning and tool calls.

Per choice, content deltas go through the reasoning parser (reasoning vs content),
then the content through the tool-call parser (text vs calls). Out come ``Delta``
events on the ``reasoning`` or ``content`` channel and ``ToolCall`` events: for each
call one with its id and name (``arguments: ""``), then one with its arguments. At a
choice's finish both parsers are flushed (a truncated reasoning block is reasoning; an
unfinished call is text), a ``stop`` after calls becomes ``tool_calls``, and usage
gains the reasoning tokens.

The parsers hold text back only while it could still be a marker, so what comes out
is the same however the engine's steps chunked the text. Without parsing configured
the stage passes events through untouched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sluice.events.types import (
    ChoiceFinished,
    Completed,
    Delta,
    Incomplete,
    LifecycleEvent,
    TextLogprob,
    ToolCall,
)

from .reasoning import Channel, ReasoningParser, make_reasoning_parser
from .tool_formats import make_tool_parser
from .tool_parsers import ContentText, ToolCallStart, ToolParser


@dataclass(frozen=True, slots=True)
class OutputParsing:
    """How one request's output is parsed (from the server's flags and the request)."""

    reasoning_parser: str | None = None
    stream_reasoning: bool = True
    enable_thinking: bool = True
    tool_parser: str | None = None
    tool_schemas: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    max_calls: int | None = None  # 1 when parallel tool calls are off

    @property
    def active(self) -> bool:
        return self.reasoning_parser is not None or self.tool_parser is not None


def tool_call_id(request_id: str, choice_index: int, call_index: int) -> str:
    """``call_`` and 24 hex digits, as SGLang's; derived from the request so a replayed
    session gives the same ids."""
    digest = hashlib.sha256(f"{request_id}/{choice_index}/{call_index}".encode()).hexdigest()
    return f"call_{digest[:24]}"


@dataclass(slots=True)
class _ChoiceParse:
    reasoning: ReasoningParser | None
    tools: ToolParser | None
    calls: int = 0
    reasoning_tokens: int = 0
    # Token counts and logprobs of input deltas whose text is still held back: they
    # ride on the next delta that comes out.
    tokens: int = 0
    logprobs: list[TextLogprob] = field(default_factory=list)


class ParseFoldStage:
    """Folds one request's text events into content, reasoning and tool-call events."""

    def __init__(
        self,
        parsing: OutputParsing | None = None,
        request_id: str = "",
    ) -> None:
        self.parsing = parsing if parsing is not None and parsing.active else None
        self.request_id = request_id
        self._choices: dict[int, _ChoiceParse] = {}

    def feed(self, events: list[LifecycleEvent]) -> list[LifecycleEvent]:
        if self.parsing is None:
            return events
        out: list[LifecycleEvent] = []
        for event in events:
            if isinstance(event, Delta) and not event.is_prompt:
                self._delta(event, out)
            elif isinstance(event, ChoiceFinished):
                out.append(self._finish(event, out))
            elif isinstance(event, (Completed, Incomplete)):
                reasoning = sum(c.reasoning_tokens for c in self._choices.values())
                out.append(replace(event, usage=replace(event.usage, reasoning_tokens=reasoning)))
            else:
                out.append(event)
        return out

    # ----------------------------------------------------------------------- per choice

    def _choice(self, index: int) -> _ChoiceParse:
        choice = self._choices.get(index)
        if choice is None:
            parsing = self.parsing
            assert parsing is not None
            reasoning = tools = None
            if parsing.reasoning_parser is not None:
                reasoning = make_reasoning_parser(
                    parsing.reasoning_parser,
                    stream_reasoning=parsing.stream_reasoning,
                    enable_thinking=parsing.enable_thinking,
                )
            if parsing.tool_parser is not None:
                tools = make_tool_parser(parsing.tool_parser, parsing.tool_schemas or None)
            choice = self._choices[index] = _ChoiceParse(reasoning, tools)
        return choice

    def _delta(self, delta: Delta, out: list[LifecycleEvent]) -> None:
        choice = self._choice(delta.choice_index)
        choice.tokens += delta.token_count
        if delta.logprobs:
            choice.logprobs.extend(delta.logprobs)
        if choice.reasoning is None:
            pieces: list[tuple[Channel, str]] = [("content", delta.text)]
        else:
            was_thinking = choice.reasoning.thinking
            pieces = choice.reasoning.feed(delta.text)
            if was_thinking or any(channel == "reasoning" for channel, _ in pieces):
                choice.reasoning_tokens += delta.token_count
        self._emit(delta, choice, pieces, out)

    def _finish(self, event: ChoiceFinished, out: list[LifecycleEvent]) -> ChoiceFinished:
        choice = self._choice(event.choice_index)
        pieces = choice.reasoning.finish() if choice.reasoning is not None else []
        template = Delta(self.request_id, event.choice_index, event.seq, "", 0)
        self._emit(template, choice, pieces, out, final=True)
        if choice.logprobs:  # logprobs of held-back text that never came out
            out.append(self._text(template, choice, "content", ""))
        reason, matched = event.finish_reason, event.matched_stop
        if choice.calls and reason == "stop":
            reason, matched = "tool_calls", None
        usage = replace(event.usage, reasoning_tokens=choice.reasoning_tokens)
        return replace(event, finish_reason=reason, matched_stop=matched, usage=usage)

    def _emit(
        self,
        source: Delta,
        choice: _ChoiceParse,
        pieces: list[tuple[Channel, str]],
        out: list[LifecycleEvent],
        *,
        final: bool = False,
    ) -> None:
        for channel, text in pieces:
            if channel == "reasoning" or choice.tools is None:
                out.append(self._text(source, choice, channel, text))
            else:
                self._tool_events(source, choice, choice.tools.feed(text), out)
        if final and choice.tools is not None:
            self._tool_events(source, choice, choice.tools.finish(), out)

    def _tool_events(
        self, source: Delta, choice: _ChoiceParse, events: list[Any], out: list[LifecycleEvent]
    ) -> None:
        limit = self.parsing.max_calls if self.parsing is not None else None
        for item in events:
            if isinstance(item, ContentText):
                out.append(self._text(source, choice, "content", item.text))
                continue
            if limit is not None and item.index >= limit:
                continue  # parallel calls are off: only the first call counts
            index = source.choice_index
            if isinstance(item, ToolCallStart):
                choice.calls += 1
                call_id = tool_call_id(self.request_id, index, item.index)
                out.append(
                    ToolCall(self.request_id, index, source.seq, item.index, call_id, item.name, "")
                )
            else:
                out.append(
                    ToolCall(
                        self.request_id, index, source.seq, item.index, None, None, item.fragment
                    )
                )

    @staticmethod
    def _text(source: Delta, choice: _ChoiceParse, channel: Channel, text: str) -> Delta:
        """A delta of ``text`` carrying the tokens and logprobs held so far."""
        logprobs = tuple(choice.logprobs) if choice.logprobs else None
        delta = replace(
            source,
            text=text,
            token_count=choice.tokens,
            logprobs=logprobs,
            token_offsets=None,
            channel=channel,
        )
        choice.tokens, choice.logprobs = 0, []
        return delta

"""The Responses projection: lifecycle events → ``ResponseStreamEvent`` objects, and the
``Response`` as the fold of those same events.

Per output item the stream is ``output_item.added`` → its parts and deltas →
``output_item.done``; an item closes when another kind of output begins or the
choice finishes. The terminal event (``response.completed`` / ``.incomplete`` /
``.failed``) carries the whole response; the fold (:class:`ResponseFold`) rebuilds it
from the events alone, and the projection builds its snapshots from that fold, so the
stored and unary bodies are by construction what the stream adds up to.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from sluice.events.types import (
    Cancelled,
    ChoiceFinished,
    Completed,
    Created,
    Delta,
    ErrorInfo,
    Failed,
    Incomplete,
    InProgress,
    LifecycleEvent,
    TextLogprob,
    ToolCall,
    Usage,
)
from sluice.http.projections import response_events as ev
from sluice.http.projections.response_events import Event, Item

TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
"""Events after which the stream of a response ends (a cancelled one just ends)."""


def responses_usage(usage: Usage) -> dict[str, Any]:
    """OpenAI's Responses usage, plus SGLang's ``prompt_tokens`` / ``completion_tokens``
    beside it (SGLang's clients read those; both schemas allow extra keys here)."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
    }


def base_response(
    response_id: str, created_at: int, config: dict[str, Any], *, background: bool
) -> dict[str, Any]:
    """A response before anything happened: status, output and usage still to come."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "queued" if background else "in_progress",
        "background": background,
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        **config,
        "output": [],
        "usage": None,
    }


def _logprob(entry: TextLogprob) -> dict[str, Any]:
    """A ``LogProb`` (bytes included): the delta events' ``ResponseLogProb`` plus bytes,
    so that a part's logprobs are exactly its deltas' logprobs."""
    return {
        "token": entry.token,
        "logprob": entry.logprob if entry.logprob is not None else 0.0,
        "bytes": list(entry.bytes),
        "top_logprobs": [
            {"token": t, "logprob": lp, "bytes": list(b)} for t, lp, b in entry.top or ()
        ],
    }


class ResponseFold:
    """A ``Response`` accumulated from its stream events, in order."""

    def __init__(self) -> None:
        self.response: dict[str, Any] | None = None
        self.output: list[Item] = []

    def apply(self, event: Event) -> None:
        kind = event["type"]
        if kind.startswith("response.") and "response" in event:
            if kind in TERMINAL_EVENTS:
                # An item never done when the response ended did not complete.
                for item in self.output:
                    if item.get("status") == "in_progress":
                        item["status"] = "incomplete"
            self.response = {**copy.deepcopy(event["response"]), "output": self.output}
            return
        match kind:
            case "response.output_item.added":
                self.output.append(copy.deepcopy(event["item"]))
            case "response.output_item.done":
                self.output[event["output_index"]] = copy.deepcopy(event["item"])
            case "response.content_part.added":
                item = self.output[event["output_index"]]
                item.setdefault("content", []).append(copy.deepcopy(event["part"]))
            case "response.content_part.done":
                parts = self.output[event["output_index"]]["content"]
                parts[event["content_index"]] = copy.deepcopy(event["part"])
            case "response.output_text.delta" | "response.reasoning_text.delta":
                part = self.output[event["output_index"]]["content"][event["content_index"]]
                part["text"] += event["delta"]
                if kind == "response.output_text.delta":
                    part["logprobs"].extend(copy.deepcopy(event["logprobs"]))
            case "response.function_call_arguments.delta":
                self.output[event["output_index"]]["arguments"] += event["delta"]
            case "response.function_call_arguments.done":
                self.output[event["output_index"]]["arguments"] = event["arguments"]

    def body(self) -> dict[str, Any]:
        if self.response is None:
            raise ValueError("nothing to fold: no response event yet")
        return copy.deepcopy(self.response)


def fold_events(events: list[Event]) -> dict[str, Any]:
    """The ``Response`` a stream of events adds up to."""
    fold = ResponseFold()
    for event in events:
        fold.apply(event)
    return fold.body()


class ResponsesProjection:
    """One response's lifecycle events → its stream events (numbered from 0)."""

    def __init__(
        self,
        base: dict[str, Any],
        *,
        new_id: Callable[[str], str],
        want_logprobs: bool,
        clock: Callable[[], int],
    ) -> None:
        self.base = base
        self.new_id = new_id
        self.want_logprobs = want_logprobs
        self.clock = clock
        self.fold = ResponseFold()
        self.events: list[Event] = []  # every event so far
        self.usage: Usage | None = None
        self.status = base["status"]
        self.opened = False
        self._started = False
        self._open: int | None = None  # output index of the item still open
        self._calls: dict[int, int] = {}  # tool call index → output index
        self._seq = 0

    # ------------------------------------------------------------------- emit

    def _emit(self, out: list[Event], event: Event) -> None:
        event["sequence_number"] = self._seq
        self._seq += 1
        self.fold.apply(event)
        self.events.append(event)
        out.append(event)

    def snapshot(self, status: str, **changes: Any) -> dict[str, Any]:
        body = copy.deepcopy(self.base)
        body.update(status=status, output=copy.deepcopy(self.fold.output), **changes)
        return body

    def _lifecycle(self, out: list[Event], kind: str, status: str, **changes: Any) -> None:
        self.status = status
        self._emit(out, ev.lifecycle(kind, self.snapshot(status, **changes)))

    def _open_response(self) -> list[Event]:
        """``response.created`` (and ``response.queued`` for a background response)."""
        out: list[Event] = []
        if not self.opened:
            self.opened = True
            self._lifecycle(out, "response.created", self.status)
            if self.status == "queued":
                self._lifecycle(out, "response.queued", "queued")
        return out

    # ---------------------------------------------------------------- project

    def project(self, batch: list[LifecycleEvent]) -> list[Event]:
        out: list[Event] = []
        try:
            self._project(batch, out)
        except ValueError as exc:  # output the stream cannot show: the response fails
            self._fail(out, ErrorInfo(f"internal error: {exc}"))
        return out

    def _project(self, batch: list[LifecycleEvent], out: list[Event]) -> None:
        for event in batch:
            if self.terminal:
                return
            match event:
                case Created():
                    out.extend(self._open_response())
                case InProgress() if not self._started:
                    self._started = True
                    self._lifecycle(out, "response.in_progress", "in_progress")
                case Delta(is_prompt=False):
                    self._delta(out, event)
                case ToolCall():
                    self._tool_call(out, event)
                case ChoiceFinished(finish_reason=reason):
                    if not self.fold.output:
                        self._open_message(out)  # an empty answer is still a message
                    self._close(out, incomplete=reason == "length")
                case Completed(usage=usage):
                    self.usage = usage
                    self._finish(out, usage, incomplete=False)
                case Incomplete(usage=usage):
                    self.usage = usage
                    self._finish(out, usage, incomplete=True)
                case Failed(error=error):
                    self._fail(out, error)
                case Cancelled():
                    self._cancel()

    def _delta(self, out: list[Event], delta: Delta) -> None:
        kind = "reasoning" if delta.channel == "reasoning" else "message"
        index = self._open
        if index is None or self.fold.output[index]["type"] != kind:
            self._close(out)
            index = self._open_reasoning(out) if kind == "reasoning" else self._open_message(out)
        item = self.fold.output[index]
        if kind == "reasoning":
            if delta.text:
                self._emit(out, ev.reasoning_text_delta(item["id"], index, delta.text))
            return
        logprobs = []
        if self.want_logprobs and delta.logprobs:
            logprobs = [_logprob(e) for e in delta.logprobs]
        if delta.text or logprobs:
            self._emit(out, ev.output_text_delta(item["id"], index, delta.text, logprobs))

    def _open_message(self, out: list[Event]) -> int:
        return self._open_item(out, ev.message_item(self.new_id("msg")), ev.output_text_part())

    def _open_reasoning(self, out: list[Event]) -> int:
        return self._open_item(out, ev.reasoning_item(self.new_id("rs")), ev.reasoning_text_part())

    def _open_item(self, out: list[Event], item: Item, part: Item) -> int:
        index = len(self.fold.output)
        self._emit(out, ev.output_item_added(index, item))
        self._emit(out, ev.content_part_added(item["id"], index, part))
        self._open = index
        return index

    def _tool_call(self, out: list[Event], call: ToolCall) -> None:
        index = self._calls.get(call.call_index)
        if index is None:
            self._close(out)
            index = len(self.fold.output)
            call_id = call.call_id or self.new_id("call")
            item = ev.function_call_item(self.new_id("fc"), call_id, call.name or "")
            self._emit(out, ev.output_item_added(index, item))
            self._calls[call.call_index] = index
            self._open = index
        elif self._open != index:
            raise ValueError(f"tool call {call.call_index} continued after another item began")
        if call.arguments:
            item_id = self.fold.output[index]["id"]
            self._emit(out, ev.function_call_arguments_delta(item_id, index, call.arguments))

    def _close(self, out: list[Event], *, incomplete: bool = False) -> None:
        """Finish the open item: its ``done`` events, then ``output_item.done``."""
        index = self._open
        if index is None:
            return
        self._open = None
        item = copy.deepcopy(self.fold.output[index])
        item_id = item["id"]
        match item["type"]:
            case "message":
                part = item["content"][0]
                self._emit(out, ev.output_text_done(item_id, index, part["text"], part["logprobs"]))
                self._emit(out, ev.content_part_done(item_id, index, part))
            case "reasoning":
                part = item["content"][0]
                self._emit(out, ev.reasoning_text_done(item_id, index, part["text"]))
                self._emit(out, ev.content_part_done(item_id, index, part))
            case _:
                done = ev.function_call_arguments_done(
                    item_id, index, item["name"], item["arguments"]
                )
                self._emit(out, done)
        item["status"] = "incomplete" if incomplete else "completed"
        self._emit(out, ev.output_item_done(index, item))

    def _finish(self, out: list[Event], usage: Usage, *, incomplete: bool) -> None:
        self._close(out)
        body = responses_usage(usage)
        if incomplete:
            reason = {"reason": "max_output_tokens"}
            self._lifecycle(
                out, "response.incomplete", "incomplete", usage=body, incomplete_details=reason
            )
        else:
            self._lifecycle(
                out, "response.completed", "completed", usage=body, completed_at=self.clock()
            )

    def _fail(self, out: list[Event], error: ErrorInfo) -> None:
        """``error`` then ``response.failed``; items left open are marked incomplete."""
        self._open = None
        for item in self.fold.output:  # as the fold of the events will mark them
            if item.get("status") == "in_progress":
                item["status"] = "incomplete"
        self._emit(out, ev.error(error.code or error.type, error.message, error.param))
        code = "server_error" if error.status >= 500 else "invalid_prompt"
        usage = responses_usage(self.usage) if self.usage is not None else None
        failure = {"code": code, "message": error.message}
        self._lifecycle(out, "response.failed", "failed", usage=usage, error=failure)

    def _cancel(self) -> dict[str, Any]:
        """The body of a cancelled response (no stream event: the stream just ends)."""
        for item in self.fold.output:
            if item.get("status") == "in_progress":
                item["status"] = "incomplete"
        self.status = "cancelled"
        self._open = None
        body = self.snapshot("cancelled")
        self.fold.response = {**body, "output": self.fold.output}
        return body

    @property
    def terminal(self) -> bool:
        return bool(self.events) and self.events[-1]["type"] in TERMINAL_EVENTS

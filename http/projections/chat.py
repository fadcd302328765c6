"""The chat projection: lifecycle events → ``chat.completion.chunk`` objects, and the
unary ``chat.completion`` as the fold of the same chunks.

Per choice the stream opens with one ``role: "assistant"`` delta, carries content
(or reasoning) deltas, and ends with exactly one chunk whose ``finish_reason`` is
set. ``reasoning_content`` is present (null when empty) in every delta, as SGLang
sends it: the OpenAI SDK reads the attribute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.events.types import (
    ChoiceFinished,
    Completed,
    Delta,
    InProgress,
    LifecycleEvent,
    TextLogprob,
    Usage,
)

Chunk = dict[str, Any]


def chat_usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def logprob_content(entry: TextLogprob) -> dict[str, Any]:
    """One ``ChatCompletionTokenLogprob``: the token, its logprob, bytes, alternatives."""
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.bytes),
        "top_logprobs": [
            {"token": text, "logprob": lp, "bytes": list(raw)} for text, lp, raw in entry.top or ()
        ],
    }


@dataclass
class _ChoiceState:
    opened: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class ChatStream:
    request_id: str
    created: int
    model: str
    want_logprobs: bool
    continuous_usage: bool = False
    usage: Usage | None = None
    _choices: dict[int, _ChoiceState] = field(default_factory=dict)

    def _chunk(self, choices: list[dict[str, Any]]) -> Chunk:
        return {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _state(self, index: int) -> _ChoiceState:
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = _ChoiceState()
        return state

    def project(self, batch: list[LifecycleEvent]) -> list[Chunk]:
        parts: dict[int, dict[str, Any]] = {}
        chunks: list[Chunk] = []
        for event in batch:
            if isinstance(event, InProgress):
                state = self._state(event.choice_index)
                state.prompt_tokens = event.prompt_tokens
                if not state.opened:
                    state.opened = True
                    role = {"role": "assistant", "content": "", "reasoning_content": None}
                    chunks.append(self._chunk([self._part(event.choice_index, role)]))
            elif isinstance(event, Delta):
                self._add_delta(parts, event)
            elif isinstance(event, ChoiceFinished):
                part = parts.get(event.choice_index)
                if part is None:
                    delta = {"reasoning_content": None}
                    part = parts[event.choice_index] = self._part(event.choice_index, delta)
                self._state(event.choice_index).completion_tokens = event.usage.completion_tokens
                part["finish_reason"] = event.finish_reason
                part["matched_stop"] = event.matched_stop
            elif isinstance(event, Completed):
                self.usage = event.usage
        for index, part in parts.items():
            chunk = self._chunk([part])
            if self.continuous_usage:
                state = self._choices[index]
                chunk["usage"] = chat_usage_body(
                    Usage(state.prompt_tokens, state.completion_tokens)
                )
            chunks.append(chunk)
        return chunks

    def usage_chunk(self) -> Chunk:
        assert self.usage is not None
        chunk = self._chunk([])
        chunk["usage"] = chat_usage_body(self.usage)
        return chunk

    def _part(self, index: int, delta: dict[str, Any]) -> dict[str, Any]:
        return {
            "index": index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": None,
            "matched_stop": None,
        }

    def _add_delta(self, parts: dict[int, dict[str, Any]], event: Delta) -> None:
        index = event.choice_index
        part = parts.get(index)
        if part is None:
            part = parts[index] = self._part(index, {"content": None, "reasoning_content": None})
        key = "reasoning_content" if event.channel == "reasoning" else "content"
        delta = part["delta"]
        delta[key] = (delta.get(key) or "") + event.text
        if self.want_logprobs and event.logprobs:
            if part["logprobs"] is None:
                part["logprobs"] = {"content": [], "refusal": None}
            part["logprobs"]["content"].extend(logprob_content(e) for e in event.logprobs)
        self._state(index).completion_tokens += event.token_count
        if delta["content"] is None:
            del delta["content"]


def fold_chat_chunks(chunks: list[Chunk], usage: Usage | None) -> dict[str, Any]:
    """The unary ``chat.completion``: every choice's deltas accumulated."""
    if not chunks:
        raise ValueError("nothing to fold: the stream produced no chunk")
    head = chunks[0]
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for part in chunk["choices"]:
            acc = choices.get(part["index"])
            if acc is None:
                acc = choices[part["index"]] = {
                    "index": part["index"],
                    "message": {
                        "role": "assistant",
                        "content": "",
                        "refusal": None,
                        "reasoning_content": None,
                    },
                    "logprobs": None,
                    "finish_reason": None,
                    "matched_stop": None,
                }
            delta, message = part["delta"], acc["message"]
            message["content"] += delta.get("content") or ""
            if delta.get("reasoning_content"):
                message["reasoning_content"] = (message["reasoning_content"] or "") + delta[
                    "reasoning_content"
                ]
            if part["logprobs"] is not None:
                if acc["logprobs"] is None:
                    acc["logprobs"] = {"content": [], "refusal": None}
                acc["logprobs"]["content"].extend(part["logprobs"]["content"])
            if part["finish_reason"] is not None:
                acc["finish_reason"] = part["finish_reason"]
                acc["matched_stop"] = part["matched_stop"]
    body: dict[str, Any] = {
        "id": head["id"],
        "object": "chat.completion",
        "created": head["created"],
        "model": head["model"],
        "choices": [choices[i] for i in sorted(choices)],
    }
    if usage is not None:
        body["usage"] = chat_usage_body(usage)
    return body

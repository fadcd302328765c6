"""The chat projection: lifecycle events → ``chat.completion.chunk`` objects, and the
unary ``chat.completion`` as the fold of the same chunks.

Per choice the stream opens with one ``role: "assistant"`` delta, carries content
(or reasoning) deltas, and ends with exactly one chunk whose ``finish_reason`` is
set. ``reasoning_content`` is present (null when empty) in every delta, as SGLang
sends it: the OpenAI SDK reads the attribute.
"""

from __future__ import annotations

from typing import Any

from sluice.events.types import Delta, TextLogprob, ToolCall, Usage

from .base import ChoiceCounts, Chunk, ChunkProjection, fold


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


class ChatStream(ChunkProjection):
    object_name = "chat.completion.chunk"

    def usage_body(self, usage: Usage) -> dict[str, Any]:
        return chat_usage_body(usage)

    def open_choice(self, index: int) -> list[Chunk]:
        """The once-per-choice role delta, before any content."""
        part = self.new_part(index)
        part["delta"] = {"role": "assistant", "content": "", "reasoning_content": None}
        return [self.chunk([part])]

    def new_part(self, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "delta": {"reasoning_content": None},
            "logprobs": None,
            "finish_reason": None,
            "matched_stop": None,
        }

    def add_delta(self, part: dict[str, Any], delta: Delta, counts: ChoiceCounts) -> None:
        key = "reasoning_content" if delta.channel == "reasoning" else "content"
        body = part["delta"]
        body[key] = (body.get(key) or "") + delta.text
        if self.want_logprobs and delta.logprobs:
            if part["logprobs"] is None:
                part["logprobs"] = {"content": [], "refusal": None}
            part["logprobs"]["content"].extend(logprob_content(e) for e in delta.logprobs)

    def add_tool_call(self, part: dict[str, Any], call: ToolCall) -> bool:
        """A call's first delta carries its id, type and name with ``arguments: ""``;
        later ones only its index and argument fragments."""
        entries: list[dict[str, Any]] = part["delta"].setdefault("tool_calls", [])
        if any(entry["index"] == call.call_index for entry in entries):
            return False
        if call.name is not None:
            entries.append(
                {
                    "index": call.call_index,
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            )
        else:
            entries.append({"index": call.call_index, "function": {"arguments": call.arguments}})
        return True


def _new_choice(index: int) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": "", "refusal": None, "reasoning_content": None},
        "logprobs": None,
        "finish_reason": None,
        "matched_stop": None,
    }


def _merge(acc: dict[str, Any], part: dict[str, Any]) -> None:
    delta, message = part["delta"], acc["message"]
    message["content"] += delta.get("content") or ""
    if delta.get("reasoning_content"):
        message["reasoning_content"] = (message["reasoning_content"] or "") + delta[
            "reasoning_content"
        ]
    for entry in delta.get("tool_calls", ()):
        calls: list[dict[str, Any]] = message.setdefault("tool_calls", [])
        index = entry["index"]
        if index == len(calls):
            calls.append(
                {"id": entry["id"], "type": "function", "function": dict(entry["function"])}
            )
        else:
            calls[index]["function"]["arguments"] += entry["function"]["arguments"]
    if part["logprobs"] is not None:
        if acc["logprobs"] is None:
            acc["logprobs"] = {"content": [], "refusal": None}
        acc["logprobs"]["content"].extend(part["logprobs"]["content"])


def fold_chat_chunks(chunks: list[Chunk], usage: Usage | None) -> dict[str, Any]:
    """The unary ``chat.completion``: every choice's deltas accumulated."""
    return fold(
        chunks,
        object_name="chat.completion",
        new_choice=_new_choice,
        merge=_merge,
        usage=chat_usage_body(usage) if usage is not None else None,
    )

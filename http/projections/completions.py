"""The completions projection: lifecycle events → ``text_completion`` chunks, and the
unary response as the fold of the very same chunks.

``CompletionStream.project(batch)`` turns one engine step's worth of events into
chunks (one per choice that changed, a choice's finish merged into its last text);
``fold_chunks`` accumulates chunks exactly as a client would, so the unary body is
by construction what the stream adds up to.
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


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _top_map(entry: TextLogprob) -> dict[str, float] | None:
    """OpenAI's ``{token: logprob}`` of the alternatives plus the chosen token."""
    if entry.top is None:
        return None
    top: dict[str, float] = {}
    for text, logprob, _ in entry.top:
        top.setdefault(text, logprob)  # best first: a duplicate text keeps its best
    if entry.logprob is not None:
        top.setdefault(entry.token, entry.logprob)
    return top


@dataclass
class _ChoiceState:
    offset: int = 0  # chars of text sent so far (echo included): the next text_offset
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class CompletionStream:
    request_id: str
    created: int
    model: str
    want_logprobs: bool
    continuous_usage: bool = False
    _choices: dict[int, _ChoiceState] = field(default_factory=dict)
    usage: Usage | None = None

    def _state(self, index: int) -> _ChoiceState:
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = _ChoiceState()
        return state

    def _chunk(self, choices: list[dict[str, Any]]) -> Chunk:
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def project(self, batch: list[LifecycleEvent]) -> list[Chunk]:
        entries: dict[int, dict[str, Any]] = {}
        for event in batch:
            if isinstance(event, InProgress):
                self._state(event.choice_index).prompt_tokens = event.prompt_tokens
            elif isinstance(event, Delta):
                self._add_delta(entries, event)
            elif isinstance(event, ChoiceFinished):
                entry = entries.get(event.choice_index) or self._new_entry(
                    entries, event.choice_index
                )
                # Tokens that released no text (EOS, a trimmed stop id) count here.
                self._choices[event.choice_index].completion_tokens = event.usage.completion_tokens
                entry["finish_reason"] = event.finish_reason
                entry["matched_stop"] = event.matched_stop
            elif isinstance(event, Completed):
                self.usage = event.usage
        chunks = []
        for index, entry in entries.items():
            chunk = self._chunk([entry])
            if self.continuous_usage:
                state = self._choices[index]
                chunk["usage"] = usage_body(Usage(state.prompt_tokens, state.completion_tokens))
            chunks.append(chunk)
        return chunks

    def usage_chunk(self) -> Chunk:
        """The final chunk of ``include_usage``: no choices, the whole request's usage."""
        assert self.usage is not None
        chunk = self._chunk([])
        chunk["usage"] = usage_body(self.usage)
        return chunk

    def _new_entry(self, entries: dict[int, dict[str, Any]], index: int) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "index": index,
            "text": "",
            "logprobs": None,
            "finish_reason": None,
            "matched_stop": None,
        }
        if self.want_logprobs:
            entry["logprobs"] = {
                "tokens": [],
                "token_logprobs": [],
                "top_logprobs": [],
                "text_offset": [],
            }
        entries[index] = entry
        self._state(index)
        return entry

    def _add_delta(self, entries: dict[int, dict[str, Any]], delta: Delta) -> None:
        entry = entries.get(delta.choice_index) or self._new_entry(entries, delta.choice_index)
        state = self._choices[delta.choice_index]
        if self.want_logprobs and delta.logprobs is not None:
            lp = entry["logprobs"]
            offsets = delta.token_offsets or (0,) * len(delta.logprobs)
            for item, offset in zip(delta.logprobs, offsets, strict=True):
                lp["tokens"].append(item.token)
                lp["token_logprobs"].append(item.logprob)
                lp["top_logprobs"].append(_top_map(item))
                lp["text_offset"].append(state.offset + offset)
        entry["text"] += delta.text
        state.offset += len(delta.text)
        if not delta.is_prompt:
            state.completion_tokens += delta.token_count


def fold_chunks(chunks: list[Chunk], usage: Usage | None) -> dict[str, Any]:
    """The unary ``text_completion``: the stream's chunks accumulated per choice."""
    if not chunks:
        raise ValueError("nothing to fold: the stream produced no chunk")
    head = chunks[0]
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for part in chunk["choices"]:
            index = part["index"]
            acc = choices.get(index)
            if acc is None:
                acc = choices[index] = {
                    "index": index,
                    "text": "",
                    "logprobs": None,
                    "finish_reason": None,
                    "matched_stop": None,
                }
            acc["text"] += part["text"]
            if part["logprobs"] is not None:
                if acc["logprobs"] is None:
                    acc["logprobs"] = {k: [] for k in part["logprobs"]}
                for key, values in part["logprobs"].items():
                    acc["logprobs"][key].extend(values)
            if part["finish_reason"] is not None:
                acc["finish_reason"] = part["finish_reason"]
                acc["matched_stop"] = part["matched_stop"]
    body: dict[str, Any] = {
        "id": head["id"],
        "object": "text_completion",
        "created": head["created"],
        "model": head["model"],
        "choices": [choices[i] for i in sorted(choices)],
    }
    if usage is not None:
        body["usage"] = usage_body(usage)
    return body


def select_best_of(
    body: dict[str, Any], *, n: int, best_of: int, keep_logprobs: bool
) -> dict[str, Any]:
    """Keep, per prompt, the ``n`` of ``best_of`` candidates with the highest cumulative
    logprob, re-indexed in OpenAI's order (prompt_index × n + j)."""
    candidates = body["choices"]
    chosen: list[dict[str, Any]] = []
    for p in range(len(candidates) // best_of):
        group = candidates[p * best_of : (p + 1) * best_of]
        ranked = sorted(
            group,
            key=lambda c: sum(lp for lp in c["logprobs"]["token_logprobs"] if lp is not None),
            reverse=True,
        )
        for j, choice in enumerate(ranked[:n]):
            choice = {**choice, "index": p * n + j}
            if not keep_logprobs:
                choice["logprobs"] = None
            chosen.append(choice)
    return {**body, "choices": chosen}

"""What the chat and completions projections share: the chunk envelope, one chunk
per changed choice per batch, a choice's finish merged into its last chunk, and
usage (per chunk with ``continuous_usage_stats``, or as the final chunk)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from sluice.events.types import (
    ChoiceFinished,
    Completed,
    Delta,
    Incomplete,
    InProgress,
    LifecycleEvent,
    ToolCall,
    Usage,
)

Chunk = dict[str, Any]


@dataclass
class ChoiceCounts:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    chars_sent: int = 0  # text sent so far, echo included (completions' text_offset)


class ChunkProjection(ABC):
    """Subclasses name the object and say how a delta and a choice's opening look."""

    object_name: ClassVar[str]

    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        *,
        want_logprobs: bool,
        continuous_usage: bool = False,
    ) -> None:
        self.request_id = request_id
        self.created = created
        self.model = model
        self.want_logprobs = want_logprobs
        self.continuous_usage = continuous_usage
        self.usage: Usage | None = None
        self.counts: dict[int, ChoiceCounts] = {}

    # ------------------------------------------------------------ for subclasses

    @abstractmethod
    def usage_body(self, usage: Usage) -> dict[str, Any]:
        """The API's ``usage`` object."""

    @abstractmethod
    def new_part(self, index: int) -> dict[str, Any]:
        """An empty choice entry of a chunk."""

    @abstractmethod
    def add_delta(self, part: dict[str, Any], delta: Delta, counts: ChoiceCounts) -> None:
        """Fold ``delta`` into this batch's ``part`` of its choice (``counts`` as before it)."""

    def open_choice(self, index: int) -> list[Chunk]:
        """Chunks that start a choice (chat's role delta); none by default."""
        return []

    def add_tool_call(self, part: dict[str, Any], call: ToolCall) -> bool:
        """Fold ``call`` into ``part``; False when ``part`` already holds an entry for its
        call index (the call then goes into a chunk of its own)."""
        raise TypeError(f"{type(self).__name__} does not carry tool calls")

    # ------------------------------------------------------------------- shared

    def chunk(self, choices: list[dict[str, Any]]) -> Chunk:
        return {
            "id": self.request_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def project(self, batch: list[LifecycleEvent]) -> list[Chunk]:
        """One batch of events (one engine step) → its chunks, in order."""
        chunks: list[Chunk] = []
        parts: dict[int, dict[str, Any]] = {}
        for event in batch:
            index = event.choice_index
            if isinstance(event, InProgress):
                if index not in self.counts:
                    self.counts[index] = ChoiceCounts(prompt_tokens=event.prompt_tokens)
                    chunks.extend(self.open_choice(index))
            elif isinstance(event, Delta):
                part = parts.get(index) or parts.setdefault(index, self.new_part(index))
                counts = self._counts(index)
                self.add_delta(part, event, counts)
                counts.chars_sent += len(event.text)
                if not event.is_prompt:
                    counts.completion_tokens += event.token_count
            elif isinstance(event, ToolCall):
                part = parts.get(index) or parts.setdefault(index, self.new_part(index))
                if not self.add_tool_call(part, event):
                    chunks.append(self._chunk_of(index, part))
                    part = parts[index] = self.new_part(index)
                    self.add_tool_call(part, event)
            elif isinstance(event, ChoiceFinished):
                part = parts.get(index) or parts.setdefault(index, self.new_part(index))
                # Tokens that released no text (EOS, a trimmed stop id) count here.
                self._counts(index).completion_tokens = event.usage.completion_tokens
                part["finish_reason"] = event.finish_reason
                part["matched_stop"] = event.matched_stop
            elif isinstance(event, Completed | Incomplete):
                self.usage = event.usage
        chunks.extend(self._chunk_of(index, part) for index, part in parts.items())
        return chunks

    def _chunk_of(self, index: int, part: dict[str, Any]) -> Chunk:
        chunk = self.chunk([part])
        if self.continuous_usage:
            counts = self._counts(index)
            chunk["usage"] = self.usage_body(Usage(counts.prompt_tokens, counts.completion_tokens))
        return chunk

    def usage_chunk(self) -> Chunk:
        """The final chunk of ``include_usage``: no choices, the whole request's usage."""
        assert self.usage is not None
        chunk = self.chunk([])
        chunk["usage"] = self.usage_body(self.usage)
        return chunk

    def _counts(self, index: int) -> ChoiceCounts:
        return self.counts.setdefault(index, ChoiceCounts())


def fold(
    chunks: list[Chunk],
    *,
    object_name: str,
    new_choice: Callable[[int], dict[str, Any]],
    merge: Callable[[dict[str, Any], dict[str, Any]], None],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """A unary body: each choice's chunk parts accumulated by ``merge``, in index order,
    with the finish its last chunk carried."""
    if not chunks:
        raise ValueError("nothing to fold: the stream produced no chunk")
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for part in chunk["choices"]:
            index = part["index"]
            acc = choices.get(index) or choices.setdefault(index, new_choice(index))
            merge(acc, part)
            if part["finish_reason"] is not None:
                acc["finish_reason"] = part["finish_reason"]
                acc["matched_stop"] = part["matched_stop"]
    head = chunks[0]
    body: dict[str, Any] = {
        "id": head["id"],
        "object": object_name,
        "created": head["created"],
        "model": head["model"],
        "choices": [choices[i] for i in sorted(choices)],
    }
    if usage is not None:
        body["usage"] = usage
    return body

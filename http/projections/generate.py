"""The ``/generate`` projection: lifecycle events → SGLang's native output objects.

Each output is ``{text, output_ids, meta_info}`` for one choice. A stream sends, per
engine step and per choice that changed, the output so far (SGLang's default,
``incremental_streaming_output`` off: text and ids are cumulative, ``finish_reason``
null until the end); the unary body is each choice's last output, one object or, for a
batch or ``n > 1``, the list of them. Logprobs are SGLang's triples
``[logprob, token_id, text or null]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.events.types import (
    ChoiceFinished,
    Completed,
    Delta,
    Incomplete,
    InProgress,
    LifecycleEvent,
    TextLogprob,
    Usage,
)

from .base import Chunk


@dataclass(frozen=True, slots=True)
class LogprobView:
    """What the request asked to see of logprobs."""

    top: int  # alternatives per position (``top_logprobs_num``)
    with_text: bool  # ``return_text_in_logprobs``
    input_start: int | None  # ``logprob_start_len``; None: no prompt logprobs


@dataclass(slots=True)
class _Output:
    text: str = ""
    ids: list[int] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[list[Any]] = field(default_factory=list)
    top: list[list[list[Any]] | None] = field(default_factory=list)
    input_logprobs: list[list[Any]] = field(default_factory=list)
    input_top: list[list[list[Any]] | None] = field(default_factory=list)


def finish_body(event: ChoiceFinished) -> dict[str, Any]:
    """SGLang's ``finish_reason`` object."""
    if event.finish_reason == "length":
        return {"type": "length", "length": event.usage.completion_tokens}
    if event.finish_reason == "abort":
        return {"type": "abort", "message": "The request was aborted (/abort_request)."}
    return {"type": "stop", "matched": event.matched_stop}


class GenerateStream:
    def __init__(
        self, request_id: str, *, batch: bool, stream: bool, logprobs: LogprobView | None
    ) -> None:
        self.request_id = request_id
        self.batch = batch
        # Outputs are cumulative: a stream sends each changed one per step; a unary body
        # is the last of each, built once (``unary_body``), not kept from every step.
        self.stream = stream
        self.logprobs = logprobs
        self.usage: Usage | None = None
        self.outputs: dict[int, _Output] = {}

    def project(self, batch: list[LifecycleEvent]) -> list[Chunk]:
        changed: dict[int, None] = {}
        for event in batch:
            index = event.choice_index
            if isinstance(event, InProgress):
                out = self._output(index)
                out.prompt_tokens, out.cached_tokens = event.prompt_tokens, event.cached_tokens
            elif isinstance(event, Delta):
                self._add(self._output(index), event)
                changed[index] = None
            elif isinstance(event, ChoiceFinished):
                out = self._output(index)
                out.finish = finish_body(event)
                out.completion_tokens = event.usage.completion_tokens
                changed[index] = None
            elif isinstance(event, Completed | Incomplete):
                self.usage = event.usage
        return [self.body(index) for index in changed] if self.stream else []

    def unary_body(self) -> Any:
        """Each choice's output, in index order; one object unless the request was a
        batch."""
        outputs = [self.body(index) for index in sorted(self.outputs)]
        return outputs if self.batch else outputs[0]

    def usage_chunk(self) -> Chunk:
        raise TypeError("/generate streams carry no usage chunk")

    def body(self, index: int) -> Chunk:
        """The output of choice ``index`` so far."""
        out = self.outputs[index]
        meta: dict[str, Any] = {
            "id": self.request_id if not self.batch else f"{self.request_id}_{index}",
            "finish_reason": out.finish,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
        }
        view = self.logprobs
        if view is not None:
            meta["input_token_logprobs"] = list(out.input_logprobs)
            meta["output_token_logprobs"] = list(out.logprobs)
            if view.top:
                meta["input_top_logprobs"] = list(out.input_top)
                meta["output_top_logprobs"] = list(out.top)
        chunk: Chunk = {"text": out.text, "output_ids": list(out.ids), "meta_info": meta}
        if self.batch:
            chunk["index"] = index
        return chunk

    def _output(self, index: int) -> _Output:
        return self.outputs.get(index) or self.outputs.setdefault(index, _Output())

    def _add(self, out: _Output, delta: Delta) -> None:
        view = self.logprobs
        if delta.is_prompt:  # the prompt's logprobs (asked with logprob_start_len)
            if view is not None and view.input_start is not None and delta.logprobs:
                entries = delta.logprobs[view.input_start :]
                out.input_logprobs.extend(self._triple(e) for e in entries)
                out.input_top.extend(self._alternatives(e) for e in entries)
            return
        out.text += delta.text
        out.ids.extend(delta.token_ids or ())
        out.completion_tokens = len(out.ids)
        if view is not None and delta.logprobs:
            out.logprobs.extend(self._triple(e) for e in delta.logprobs)
            out.top.extend(self._alternatives(e) for e in delta.logprobs)

    def _triple(self, entry: TextLogprob) -> list[Any]:
        assert self.logprobs is not None
        return [entry.logprob, entry.token_id, entry.token if self.logprobs.with_text else None]

    def _alternatives(self, entry: TextLogprob) -> list[list[Any]] | None:
        assert self.logprobs is not None
        if entry.top is None or entry.top_ids is None:
            return None
        with_text = self.logprobs.with_text
        return [
            [logprob, token_id, text if with_text else None]
            for (text, logprob, _), token_id in zip(entry.top, entry.top_ids, strict=True)
        ]

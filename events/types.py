"""The typed events that flow through the pipeline.

Two families share one envelope (request id, choice index, sequence number):

* engine events, emitted by the step-batch stage for one sequence (one choice):
  ``PromptProcessed``, ``TokenSampled``, ``SequenceFinished``;
* lifecycle events, emitted by the detokenize / parse-fold stages and read by the
  projections: ``Created``, ``InProgress``, ``Delta``, ``ToolCall``,
  ``ChoiceFinished`` and the terminal ``Completed`` / ``Incomplete`` / ``Failed`` /
  ``Cancelled``.

Events are frozen and slotted: they are shared between stages and recorded as-is.
Request-level events carry ``choice_index == REQUEST``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

REQUEST = -1
"""Choice index of events that concern the whole request rather than one choice."""

FinishReason = Literal["stop", "length", "abort", "tool_calls"]
EngineFinishReason = Literal["stop", "length", "abort"]


# --------------------------------------------------------------------------- engine


UNNUMBERED = -1
"""The ``seq`` of a lifecycle event a stage made: the run numbers each as it leaves."""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The logprob of one chosen token and the best alternatives, by token id."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class PromptProcessed:
    """The prompt of a sequence is in the KV cache (prefill done)."""

    request_id: str
    choice_index: int
    seq: int
    prompt_tokens: int
    cached_tokens: int
    # One entry per prompt token when prompt logprobs were asked for; the first is None
    # (it has no context to be predicted from).
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass(frozen=True, slots=True)
class TokenSampled:
    request_id: str
    choice_index: int
    seq: int
    token_id: int
    logprob: TokenLogprob | None = None


@dataclass(frozen=True, slots=True)
class SequenceFinished:
    """The engine retired the sequence. ``matched_token`` is the EOS / stop id hit."""

    request_id: str
    choice_index: int
    seq: int
    reason: EngineFinishReason
    completion_tokens: int
    matched_token: int | None = None
    error: str | None = None


EngineEvent = PromptProcessed | TokenSampled | SequenceFinished


# ------------------------------------------------------------------------ lifecycle


@dataclass(frozen=True, slots=True)
class TextLogprob:
    """A token's logprob as the API shows it: decoded text and UTF-8 bytes."""

    token: str
    logprob: float | None
    bytes: tuple[int, ...]
    top: tuple[tuple[str, float, tuple[int, ...]], ...] | None
    # The ids of ``token`` and of each ``top`` entry, when the job shows token ids.
    token_id: int | None = None
    top_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Created:
    request_id: str
    choice_index: int
    seq: int
    created_at: int
    model: str


@dataclass(frozen=True, slots=True)
class InProgress:
    """A choice's prompt was accepted by the engine; ``echo_*`` is set for ``echo``."""

    request_id: str
    choice_index: int
    seq: int
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Delta:
    """New text for one choice. ``logprobs`` covers the tokens whose text this is."""

    request_id: str
    choice_index: int
    seq: int
    text: str
    token_count: int
    logprobs: tuple[TextLogprob, ...] | None = None
    # Where each logprob's token starts in ``text`` (the completions ``text_offset``).
    token_offsets: tuple[int, ...] | None = None
    is_prompt: bool = False
    channel: Literal["content", "reasoning"] = "content"
    # The generated token ids this text came from, when the job asks for them (SGLang's
    # ``/generate`` returns ``output_ids``); a finish may release ids with no text.
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call (or a fragment of one) parsed out of a choice's text."""

    request_id: str
    choice_index: int
    seq: int
    call_index: int
    call_id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True, slots=True)
class ChoiceFinished:
    request_id: str
    choice_index: int
    seq: int
    finish_reason: FinishReason
    matched_stop: int | str | None
    usage: Usage


@dataclass(frozen=True, slots=True)
class Completed:
    request_id: str
    choice_index: int
    seq: int
    usage: Usage


@dataclass(frozen=True, slots=True)
class Incomplete:
    """Every choice finished, and at least one on its token limit (``reason``:
    ``"length"``)."""

    request_id: str
    choice_index: int
    seq: int
    usage: Usage
    reason: str


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    message: str
    type: str = "server_error"
    code: str | None = None
    param: str | None = None
    status: int = 500


@dataclass(frozen=True, slots=True)
class Failed:
    request_id: str
    choice_index: int
    seq: int
    error: ErrorInfo


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The request was ended before it finished: its client went away, or it was
    cancelled (``reason`` says which)."""

    request_id: str
    choice_index: int
    seq: int
    reason: str


LifecycleEvent = (
    Created
    | InProgress
    | Delta
    | ToolCall
    | ChoiceFinished
    | Completed
    | Incomplete
    | Failed
    | Cancelled
)
TerminalEvent = Completed | Incomplete | Failed | Cancelled
Ended = Completed | Incomplete
"""The request ran to its end: every choice finished (``Incomplete``: some on a limit)."""


def terminal_of(batch: Iterable[LifecycleEvent]) -> TerminalEvent | None:
    """The event of ``batch`` that ends its run, if any: the one place that says so."""
    for event in batch:
        if isinstance(event, Completed | Incomplete | Failed | Cancelled):
            return event
    return None


Event = EngineEvent | LifecycleEvent

"""A generation job: what every API route hands the pipeline once it has validated
its request. Chat, completions and Responses all reduce to this."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.engine.params import SamplingParams

from .parse_fold import OutputParsing


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt given as text (tokenized by the pipeline) or as token ids."""

    text: str | None = None
    ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class FieldNames:
    """How the request spelled the fields the pipeline checks, so that a refusal names
    the client's own field: chat's prompt is ``messages``, Responses' ``input``,
    ``/generate``'s ``text`` or ``input_ids``; the output limit is ``max_tokens``,
    ``max_completion_tokens``, ``max_output_tokens`` or ``max_new_tokens``."""

    prompt: str = "prompt"
    max_tokens: str = "max_tokens"
    # Where the sampling fields sit: ``/generate`` nests them in ``sampling_params``.
    sampling_prefix: str = ""
    # The field that gave the output constraint (``regex``, ``response_format``, …).
    constraint: str = "response_format"

    def sampling(self, name: str) -> str:
        return f"{self.sampling_prefix}{name}"


PROMPT_NAMES = FieldNames()
"""The completions API's names, which the other routes' differ from."""
CHAT_NAMES = FieldNames(prompt="messages")


@dataclass(frozen=True, slots=True)
class GenerationJob:
    request_id: str
    created: int
    model: str
    prompts: tuple[Prompt, ...]
    sampling: SamplingParams
    n: int = 1
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    echo: bool = False
    # Whether deltas carry per-token logprobs (the engine computes them when
    # ``sampling.logprobs`` is set; ``best_of`` asks the engine without showing them).
    show_logprobs: bool = False
    # Whether deltas carry the generated token ids (SGLang's ``/generate``).
    show_token_ids: bool = False
    # Reasoning and tool-call parsing of the output (chat and Responses); None: plain text.
    parsing: OutputParsing | None = None
    # Which cache the request should find: ``prompt_cache_key``, else ``user`` (OpenAI
    # used ``user`` for this before it had the key). Routes it among engine workers.
    routing_key: str | None = None
    names: FieldNames = PROMPT_NAMES

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

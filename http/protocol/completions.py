"""``POST /v1/completions``: the decoded JSON body → a validated, normalised request."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.engine.params import SamplingParams
from sluice.http.protocol.common import (
    read_prompt_cache_key,
    read_sampling,
    read_stop,
    read_stream_options,
    refuse_unsupported,
)
from sluice.http.protocol.fields import Fields, json_type, type_error
from sluice.http.protocol.structured import read_completion_constraint

Prompt = str | tuple[int, ...]
"""One prompt: text, or token ids (checked against the vocabulary later, by the server)."""

DEFAULT_MAX_TOKENS = 16
MAX_N = 128
MAX_BEST_OF = 20
MAX_CHOICES = 4096
"""Sequences one request may start, prompts × ``n`` (or ``best_of``): SGLang's
``MAX_OPENAI_CHOICES``."""
MAX_LOGPROBS = 5

_PROMPT_SHAPES = (
    "a string, an array of strings, an array of token ids or an array of arrays of token ids"
)


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A completions request, every field validated and defaulted.

    ``prompts`` holds one entry per prompt; choices are generated ``n`` per prompt.
    ``best_of`` is ``None`` unless more candidates than ``n`` are wanted.
    A structured-output constraint (``regex``, ``ebnf``, ``json_schema``) is
    ``sampling.constraint``.
    """

    model: str
    prompts: tuple[Prompt, ...]
    sampling: SamplingParams
    echo: bool = False
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    prompt_cache_key: str | None = None


def parse_completion_request(body: object) -> CompletionRequest:
    """Validate a decoded ``/v1/completions`` body; raise a 400 ``ApiError`` naming the field."""
    fields = Fields.of_body(body)
    model = fields.required_string("model")
    prompts = _read_prompts(fields)
    # Infill needs a model trained for it and a template; plain suffix text would mislead.
    if fields.string("suffix"):
        raise fields.error("suffix", "suffix is not supported by this model")
    echo = fields.boolean("echo", False)
    max_tokens = fields.integer("max_tokens", DEFAULT_MAX_TOKENS, minimum=0)
    if max_tokens == 0 and not echo:  # zero new tokens only makes sense for scoring the echo
        raise fields.error("max_tokens", "max_tokens must be at least 1 unless echo is true, got 0")
    n = fields.integer("n", 1, minimum=1, maximum=MAX_N)
    _check_choices(fields, "n", n, len(prompts))
    stream = fields.boolean("stream", False)
    best_of = _read_best_of(fields, n=n, stream=stream)
    if best_of is not None:
        _check_choices(fields, "best_of", best_of, len(prompts))
    stream_options = read_stream_options(fields, stream=stream)
    logprobs = fields.integer("logprobs", minimum=0, maximum=MAX_LOGPROBS)
    request = CompletionRequest(
        model=model,
        prompts=prompts,
        sampling=read_sampling(
            fields,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=logprobs if echo else None,
            constraint=read_completion_constraint(fields),
        ),
        echo=echo,
        n=n,
        best_of=best_of,
        stream=stream,
        include_usage=stream_options.include_usage,
        continuous_usage_stats=stream_options.continuous_usage_stats,
        logprobs=logprobs,
        stop=read_stop(fields),
        no_stop_trim=fields.boolean("no_stop_trim", False),
        skip_special_tokens=fields.boolean("skip_special_tokens", True),
        user=fields.string("user"),
        prompt_cache_key=read_prompt_cache_key(fields),
    )
    refuse_unsupported(fields)
    fields.finish()
    return request


def _read_prompts(fields: Fields) -> tuple[Prompt, ...]:
    """The four JSON shapes of ``prompt``, as one tuple of prompts.

    Any empty prompt is refused, not only an all-empty list (SGLang's check): an empty
    prompt leaves nothing to generate from.
    """
    value = fields.take("prompt")
    if value is None:
        raise fields.error("prompt", "Missing required parameter: 'prompt'.")
    prompts: list[Prompt]
    if isinstance(value, str):
        prompts = [value]
    elif not isinstance(value, list):
        raise type_error(fields.param("prompt"), _PROMPT_SHAPES, value)
    elif all(isinstance(item, str) for item in value):  # also the empty list
        prompts = list(value)
    elif all(isinstance(item, list) for item in value):
        prompts = [_token_ids(fields, item) for item in value]
    else:
        prompts = [_token_ids(fields, value)]
    if not prompts or any(len(prompt) == 0 for prompt in prompts):
        raise fields.error("prompt", "Prompt cannot be empty")
    return tuple(prompts)


def _token_ids(fields: Fields, items: list[object]) -> tuple[int, ...]:
    ids = []
    for item in items:
        if not isinstance(item, int) or isinstance(item, bool):
            raise fields.error(
                "prompt", f"prompt token ids must be integers, got {json_type(item)}"
            )
        if item < 0:
            raise fields.error("prompt", f"prompt token ids must be at least 0, got {item}")
        ids.append(item)
    return tuple(ids)


def _check_choices(fields: Fields, name: str, per_prompt: int, prompts: int) -> None:
    if per_prompt * prompts > MAX_CHOICES:
        raise fields.error(
            name,
            f"{name} × the number of prompts must be at most {MAX_CHOICES}, "
            f"got {per_prompt} × {prompts}",
        )


def _read_best_of(fields: Fields, *, n: int, stream: bool) -> int | None:
    """``best_of``, or ``None`` when it asks for no more candidates than ``n`` anyway."""
    best_of = fields.integer("best_of", minimum=1, maximum=MAX_BEST_OF)
    if best_of is None or best_of == n:
        return None
    if best_of < n:
        raise fields.error("best_of", f"best_of must be at least n ({n}), got {best_of}")
    if stream:  # the best candidates are only known once all have finished
        raise fields.error("best_of", "best_of cannot be used with stream")
    return best_of

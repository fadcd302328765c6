"""The readers for the request fields that several endpoints share (sampling, stop,
stream options, metadata, SGLang's extensions), so that every endpoint accepts and
refuses the same values; each reads through a :class:`~sluice.http.protocol.fields.Fields`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

from sluice.engine.params import Constraint, SamplingParams
from sluice.http.protocol.fields import (
    INT64_MAX,
    INT64_MIN,
    Fields,
    show,
    type_error,
)

MAX_STOP = 4
# Each choice's stop matcher holds every prefix of every stop string, quadratic in the
# length: one stop of 100 000 chars would hold 5·10⁹ chars; 4 of 1024 cost 2.5 ms per
# choice to build, 10 s of event loop for 4096 choices.
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
GREEDY_BELOW = 1e-6
"""Temperatures below this are greedy, as in SGLang."""

# ASCII digits only (``str.isdecimal`` accepts other scripts' digits); ten digits are far
# beyond any vocabulary and keep ``int()`` cheap.
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")


# --------------------------------------------------------------------- shared readers


@dataclass(frozen=True, slots=True)
class StreamOptions:
    """``stream_options``: what a stream reports besides the generated text."""

    include_usage: bool = False
    continuous_usage_stats: bool = False  # SGLang: usage on every chunk


def read_stream_options(fields: Fields, *, stream: bool) -> StreamOptions:
    options = fields.object("stream_options")
    if options is None:
        return StreamOptions()
    if not stream:
        raise fields.error("stream_options", "stream_options is only allowed when stream is true")
    result = StreamOptions(
        include_usage=options.boolean("include_usage", False),
        continuous_usage_stats=options.boolean("continuous_usage_stats", False),
    )
    # Obfuscation pads chunks against length side channels; a local server never adds it.
    if options.boolean("include_obfuscation", False):
        raise options.error("include_obfuscation", "include_obfuscation is not supported")
    options.finish()
    return result


def read_stop(fields: Fields) -> tuple[str, ...]:
    """``stop``: a string or 1 to 4 non-empty strings (OpenAI's ``StopConfiguration``) of at
    most ``MAX_STOP_CHARS`` characters."""
    stop = fields.strings("stop")
    if stop is None:
        return ()
    if not 1 <= len(stop) <= MAX_STOP:
        raise fields.error(
            "stop", f"stop must have between 1 and {MAX_STOP} entries, got {len(stop)}"
        )
    if "" in stop:
        raise fields.error("stop", "stop sequences must not be empty")
    longest = max(map(len, stop))
    if longest > MAX_STOP_CHARS:
        raise fields.error(
            "stop",
            f"stop sequences must be at most {MAX_STOP_CHARS} characters long, got {longest}",
        )
    return stop


def read_logit_bias(fields: Fields) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: token id (a decimal string key) → bias in [-100, 100], sorted by id.

    Ids are only checked against the vocabulary later, by the server, which knows it.
    """
    value = fields.take("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise type_error(fields.param("logit_bias"), "an object", value)
    if len(value) > MAX_LOGIT_BIAS:
        raise fields.error(
            "logit_bias",
            f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, got {len(value)}",
        )
    bias: dict[int, float] = {}
    for key, amount in value.items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise fields.error(
                "logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {show(key)}"
            )
        # The range test also refuses NaN and infinities.
        if (
            not isinstance(amount, int | float)
            or isinstance(amount, bool)
            or not (-100 <= amount <= 100)
        ):
            raise fields.error(
                "logit_bias",
                "logit_bias values must be numbers between -100 and 100, "
                f"got {show(amount)} for token {key}",
            )
        bias[int(key)] = float(amount)
    return tuple(sorted(bias.items()))


def read_sampling(
    fields: Fields,
    *,
    max_tokens: int,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    constraint: Constraint | None = None,
    max_tokens_name: str = "max_tokens",
    min_tokens_name: str = "min_tokens",
    seed_name: str = "seed",
) -> SamplingParams:
    """The engine's sampling parameters from the OpenAI fields and SGLang's extensions.

    ``max_tokens``, the logprob counts and the structured-output ``constraint`` are
    passed in because the endpoints spell them differently; so are the names that
    SGLang's native ``sampling_params`` spell otherwise.
    """
    temperature = fields.number("temperature", 1.0, minimum=0, maximum=2)
    top_k = fields.integer("top_k", -1)
    if top_k == 0 or top_k < -1:
        raise fields.error("top_k", f"top_k must be -1 (disabled) or at least 1, got {top_k}")
    min_tokens = fields.integer(min_tokens_name, 0, minimum=0)
    if min_tokens > max_tokens:
        raise fields.error(
            min_tokens_name,
            f"{min_tokens_name} must be at most {max_tokens_name} ({max_tokens}), got {min_tokens}",
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=fields.number("top_p", 1.0, minimum=0, maximum=1, exclusive_minimum=True),
        top_k=top_k,
        min_p=fields.number("min_p", 0.0, minimum=0, maximum=1),
        presence_penalty=fields.number("presence_penalty", 0.0, minimum=-2, maximum=2),
        frequency_penalty=fields.number("frequency_penalty", 0.0, minimum=-2, maximum=2),
        repetition_penalty=fields.number(
            "repetition_penalty", 1.0, minimum=0, maximum=2, exclusive_minimum=True
        ),
        logit_bias=read_logit_bias(fields),
        seed=fields.integer(seed_name, minimum=INT64_MIN, maximum=INT64_MAX),
        min_tokens=min_tokens,
        stop_token_ids=frozenset(
            fields.integers("stop_token_ids", minimum=0, max_items=MAX_STOP_TOKEN_IDS) or ()
        ),
        ignore_eos=fields.boolean("ignore_eos", False),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        constraint=constraint,
    )


def refuse_unsupported(fields: Fields) -> None:
    """Type-check SGLang options of which only the default is implemented, refusing others."""
    refuse_decoding_options(fields)
    refuse_priority(fields)


def refuse_decoding_options(fields: Fields) -> None:
    """SGLang's sampling options with only their default implemented."""
    if not fields.boolean("spaces_between_special_tokens", True):
        raise fields.error(
            "spaces_between_special_tokens", "spaces_between_special_tokens=false is not supported"
        )
    if fields.strings("stop_regex") is not None:
        raise fields.error("stop_regex", "stop_regex is not supported yet")


def refuse_priority(fields: Fields) -> None:
    """SGLang's priority scheduling (``--enable-priority-scheduling``) is not built; SMG,
    the gateway, sends ``priority: 0`` on the requests it forwards."""
    if fields.integer("priority", 0, minimum=INT64_MIN, maximum=INT64_MAX) != 0:
        raise fields.error("priority", "priority scheduling is not supported: send 0")


MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_PROMPT_CACHE_KEY = 1024


def read_prompt_cache_key(fields: Fields) -> str | None:
    """``prompt_cache_key``: requests that share one go to the engine worker that served
    the others (``--dp-size``), so they find its prefix cache; on one engine every
    request shares its cache already."""
    key = fields.string("prompt_cache_key")
    if key is not None and not 0 < len(key) <= MAX_PROMPT_CACHE_KEY:
        raise fields.error(
            "prompt_cache_key",
            f"prompt_cache_key must be 1 to {MAX_PROMPT_CACHE_KEY} characters, got {len(key)}",
        )
    return key


def read_metadata(fields: Fields) -> dict[str, str] | None:
    """``metadata``: OpenAI's limits (16 pairs, keys ≤ 64 chars, string values ≤ 512)."""
    metadata = fields.take("metadata")
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise type_error(fields.param("metadata"), "an object", metadata)
    if len(metadata) > MAX_METADATA_PAIRS:
        raise fields.error(
            "metadata",
            f"metadata must have at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise fields.error(
                "metadata", f"metadata keys must be at most {MAX_METADATA_KEY} characters"
            )
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise fields.error(
                "metadata",
                f"metadata values must be strings of at most {MAX_METADATA_VALUE} characters",
            )
    return dict(metadata)


MAX_TEMPLATE_KWARGS_BYTES = 64 << 10
"""``chat_template_kwargs`` as JSON: switches such as ``enable_thinking``, not documents."""


def read_template_kwargs(fields: Fields) -> dict[str, object]:
    """SGLang's ``chat_template_kwargs``: an object of template switches, size-bounded."""
    kwargs = fields.take("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise type_error(fields.param("chat_template_kwargs"), "an object", kwargs)
    try:
        size = len(orjson.dumps(kwargs))
    except orjson.JSONEncodeError:  # integers past 64 bits, nesting past 255 levels
        size = None
    if size is None or size > MAX_TEMPLATE_KWARGS_BYTES:
        raise fields.error(
            "chat_template_kwargs",
            f"chat_template_kwargs must be JSON of at most {MAX_TEMPLATE_KWARGS_BYTES} bytes",
        )
    return dict(kwargs)

"""orjson (de)serialisation of events: one JSON object per event, tagged by ``type``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from .types import (
    Cancelled,
    ChoiceFinished,
    Completed,
    Created,
    Delta,
    ErrorInfo,
    Event,
    Failed,
    Incomplete,
    InProgress,
    PromptProcessed,
    SequenceFinished,
    TextLogprob,
    TokenLogprob,
    TokenSampled,
    ToolCall,
    Usage,
)


def event_to_dict(event: Event) -> dict[str, Any]:
    """The event as plain JSON types, with its ``type`` tag first."""
    body: dict[str, Any] = orjson.loads(orjson.dumps(event))
    return {"type": type(event).__name__, **body}


def encode_event(event: Event) -> bytes:
    return orjson.dumps(event_to_dict(event))


def _token_logprob(d: dict[str, Any] | None) -> TokenLogprob | None:
    if d is None:
        return None
    return TokenLogprob(d["token_id"], d["logprob"], tuple((t, lp) for t, lp in d["top"]))


def _text_logprob(d: dict[str, Any]) -> TextLogprob:
    top, top_ids = d["top"], d.get("top_ids")
    return TextLogprob(
        token=d["token"],
        logprob=d["logprob"],
        bytes=tuple(d["bytes"]),
        top=None if top is None else tuple((t, lp, tuple(b)) for t, lp, b in top),
        token_id=d.get("token_id"),
        top_ids=None if top_ids is None else tuple(top_ids),
    )


def _usage(d: dict[str, Any]) -> Usage:
    return Usage(**d)


def _prompt_processed(d: dict[str, Any]) -> PromptProcessed:
    plp = d.pop("prompt_logprobs")
    return PromptProcessed(
        **d, prompt_logprobs=None if plp is None else tuple(_token_logprob(x) for x in plp)
    )


def _token_sampled(d: dict[str, Any]) -> TokenSampled:
    return TokenSampled(**{**d, "logprob": _token_logprob(d["logprob"])})


def _delta(d: dict[str, Any]) -> Delta:
    lps, offsets, ids = d["logprobs"], d["token_offsets"], d.get("token_ids")
    return Delta(
        **{
            **d,
            "logprobs": None if lps is None else tuple(map(_text_logprob, lps)),
            "token_offsets": None if offsets is None else tuple(offsets),
            "token_ids": None if ids is None else tuple(ids),
        }
    )


_DECODERS: dict[str, Callable[[dict[str, Any]], Event]] = {
    "PromptProcessed": _prompt_processed,
    "TokenSampled": _token_sampled,
    "SequenceFinished": lambda d: SequenceFinished(**d),
    "Created": lambda d: Created(**d),
    "InProgress": lambda d: InProgress(**d),
    "Delta": _delta,
    "ToolCall": lambda d: ToolCall(**d),
    "ChoiceFinished": lambda d: ChoiceFinished(**{**d, "usage": _usage(d["usage"])}),
    "Completed": lambda d: Completed(**{**d, "usage": _usage(d["usage"])}),
    "Incomplete": lambda d: Incomplete(**{**d, "usage": _usage(d["usage"])}),
    "Failed": lambda d: Failed(**{**d, "error": ErrorInfo(**d["error"])}),
    "Cancelled": lambda d: Cancelled(**d),
}


def event_from_dict(data: dict[str, Any]) -> Event:
    body = dict(data)
    kind = body.pop("type")
    try:
        decoder = _DECODERS[kind]
    except KeyError:
        raise ValueError(f"unknown event type {kind!r}") from None
    return decoder(body)


def decode_event(raw: bytes | str) -> Event:
    return event_from_dict(orjson.loads(raw))

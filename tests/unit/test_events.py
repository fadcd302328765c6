"""Events survive orjson round trips unchanged, and the package never shadows the
standard library's ``http``."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from sluice.events.codec import decode_event, encode_event, event_to_dict
from sluice.events.types import (
    REQUEST,
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

REPO = Path(__file__).resolve().parents[2]

EVENTS: list[Event] = [
    PromptProcessed("r", 0, 0, 5, 2, (None, TokenLogprob(7, -1.5, ((7, -1.5), (8, -2.0))))),
    TokenSampled("r", 1, 3, 42, TokenLogprob(42, -0.25, ((42, -0.25),))),
    TokenSampled("r", 1, 4, 43),
    SequenceFinished("r", 0, 9, "stop", 4, matched_token=2),
    SequenceFinished("r", 0, 9, "abort", 1, error="boom"),
    Created("r", REQUEST, 0, 1_700_000_000, "m"),
    InProgress("r", 0, 1, 5, 0),
    Delta(
        "r",
        0,
        2,
        "héllo",
        2,
        (
            TextLogprob("h", -0.1, (104,), (("h", -0.1, (104,)),)),
            TextLogprob("éllo", None, (195, 169), None),
        ),
        token_offsets=(0, 1),
    ),
    Delta("r", 0, 3, "prompt", 0, is_prompt=True),
    ToolCall("r", 0, 4, 0, "call_1", "f", '{"a": 1}'),
    ChoiceFinished("r", 0, 5, "stop", "\n\n", Usage(5, 3, 1)),
    ChoiceFinished("r", 1, 6, "length", None, Usage(5, 16)),
    Completed("r", REQUEST, 7, Usage(5, 19, 1, 0)),
    Incomplete("r", REQUEST, 7, Usage(5, 16), "max_output_tokens"),
    Failed("r", REQUEST, 8, ErrorInfo("bad", "invalid_request_error", "x", "p", 400)),
    Cancelled("r", REQUEST, 9, "client disconnected"),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_round_trip(event: Event) -> None:
    raw = encode_event(event)
    assert decode_event(raw) == event
    assert event_to_dict(event)["type"] == type(event).__name__


def test_envelope_fields_present_on_every_event() -> None:
    for event in EVENTS:
        data = event_to_dict(event)
        assert {"request_id", "choice_index", "seq"} <= data.keys()


def test_unknown_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown event type"):
        decode_event(b'{"type": "Nope"}')


def test_events_are_immutable() -> None:
    event = TokenSampled("r", 0, 0, 1)
    with pytest.raises(AttributeError):
        event.token_id = 2  # type: ignore[misc]


def test_http_folder_never_shadows_the_standard_library() -> None:
    """Even with the checkout root first on sys.path (``python -c`` from the repo), the
    standard library's ``http`` is what aiohttp gets."""
    code = "import http.cookies, aiohttp.web, sluice.http.app; print(http.cookies.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(out.stdout.strip()).resolve().is_relative_to(stdlib)

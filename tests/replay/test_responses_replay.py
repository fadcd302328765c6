"""Recorded ``/v1/responses`` sessions (``tests/recordings/responses``, recorded from the
real server with the real model) re-run through the route with no model: byte-identical
bytes, every body and event valid against the spec, the stream's fold equal to its
terminal response, and a replay that notices a changed engine token."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest

from sluice.events.recorder import Recording
from sluice.http.projections.responses import fold_events
from sluice.pipeline.chat import ChatSetup
from sluice.pipeline.token_text import TokenTexts
from sluice.replay.cli import replay_recording
from tests.support.openapi import validate
from tests.support.responses_spec import check_response, check_stream, parse_sse

HERE = Path(__file__).parents[1] / "recordings" / "responses"
RECORDINGS = sorted(HERE.glob("*.jsonl"))
FRANCE_ANSWER = "The capital of France is Paris."


def load(name: str) -> Recording:
    return Recording.from_jsonl((HERE / f"{name}.jsonl").read_bytes())


def replay(recording: Recording, tokenizer: Any) -> tuple[int, bytes]:
    setup = ChatSetup.for_tokenizer(None, tokenizer)
    return anyio.run(replay_recording, recording, tokenizer, TokenTexts(tokenizer), setup)


def test_recordings_exist() -> None:
    assert len(RECORDINGS) >= 7
    assert all(Recording.from_jsonl(p.read_bytes()).route == "/v1/responses" for p in RECORDINGS)


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda p: p.stem)
def test_replay_is_byte_identical(path: Path, tokenizer: Any) -> None:
    recording = Recording.from_jsonl(path.read_bytes())
    assert replay(recording, tokenizer) == (recording.status, recording.output)


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda p: p.stem)
def test_recorded_outputs_match_the_spec(path: Path) -> None:
    recording = Recording.from_jsonl(path.read_bytes())
    if recording.status != 200:
        validate("ErrorResponse", orjson.loads(recording.output))
        return
    if recording.body.get("stream"):
        events = parse_sse(recording.output)
        check_stream(events)
        assert fold_events(events) == events[-1]["response"]
    else:
        check_response(orjson.loads(recording.output))


def test_stream_and_unary_agree() -> None:
    stream = parse_sse(load("stream").output)
    unary = orjson.loads(load("unary").output)
    text = "".join(e["delta"] for e in stream if e["type"] == "response.output_text.delta")
    assert text == FRANCE_ANSWER == unary["output"][0]["content"][0]["text"]
    # The second of the two requests found the prompt in the prefix cache.
    streamed, alone = stream[-1]["response"]["usage"], unary["usage"]
    for usage in (streamed, alone):
        del usage["input_tokens_details"]
    assert streamed == alone


def test_recorded_shapes() -> None:
    incomplete = parse_sse(load("stream-incomplete").output)
    assert incomplete[-1]["type"] == "response.incomplete"
    assert incomplete[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    logprobs = parse_sse(load("stream-logprobs").output)
    deltas = [e for e in logprobs if e["type"] == "response.output_text.delta"]
    assert deltas and all(e["logprobs"] for e in deltas)
    items = orjson.loads(load("unary-items-store-false").output)
    assert items["store"] is False and items["output"][0]["content"][0]["text"]
    seeded = orjson.loads(load("unary-seeded-instructions-metadata").output)
    assert (seeded["instructions"], seeded["metadata"], seeded["user"]) == (
        "Answer in French.", {"case": "seeded"}, "u-1",
    )  # fmt: skip
    error = orjson.loads(load("unary-context-error").output)
    assert error["error"]["code"] == "context_length_exceeded"


def test_replay_cli_passes_every_recording() -> None:
    out = subprocess.run(
        [sys.executable, "-P", "-m", "sluice.replay", str(HERE)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(RECORDINGS)} passed, 0 failed" in out.stdout

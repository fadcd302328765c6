"""Recorded sessions re-run through the pipeline with no model: byte-identical
responses, shapes valid against the OpenAPI spec, and a replay that notices when
the engine's events change."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest

from sluice.events.recorder import Recording
from sluice.events.types import TokenSampled
from sluice.pipeline.chat import ChatSetup
from sluice.pipeline.token_text import TokenTexts
from sluice.replay.cli import replay_recording, rerun
from tests.support.openapi import validate

HERE = Path(__file__).parents[1] / "recordings"
COMPLETIONS = sorted((HERE / "completions").glob("*.jsonl"))
CHAT = sorted((HERE / "chat").glob("*.jsonl"))
# Native tool-call and reasoning formats (scripted engines; see make_tool_recordings.py).
TOOLS = sorted((HERE / "tools").glob("*.jsonl"))
RECORDINGS = COMPLETIONS + CHAT + TOOLS
RESPONSES = sorted((HERE / "responses").glob("*.jsonl"))


def replay(recording: Recording, tokenizer: Any) -> tuple[int, bytes]:
    setup = ChatSetup.for_tokenizer(None, tokenizer)
    return anyio.run(replay_recording, recording, tokenizer, TokenTexts(tokenizer), setup)


def rerun_of(recording: Recording, tokenizer: Any) -> Recording:
    setup = ChatSetup.for_tokenizer(None, tokenizer)
    return anyio.run(rerun, recording, tokenizer, TokenTexts(tokenizer), setup)


def sse_payloads(raw: bytes) -> list[Any]:
    frames = [f for f in raw.split(b"\n\n") if f]
    assert all(f.startswith(b"data: ") for f in frames)
    assert frames[-1] == b"data: [DONE]"
    return [orjson.loads(f[len(b"data: ") :]) for f in frames[:-1]]


def test_recordings_exist() -> None:
    assert len(COMPLETIONS) >= 8 and len(CHAT) >= 6 and len(TOOLS) >= 26


@pytest.mark.parametrize("path", RECORDINGS + RESPONSES, ids=lambda p: p.stem)
def test_replay_is_byte_and_event_identical(path: Path, tokenizer: Any) -> None:
    recording = Recording.from_jsonl(path.read_bytes())
    replayed = rerun_of(recording, tokenizer)
    assert (replayed.status, replayed.output) == (recording.status, recording.output)
    assert replayed.lifecycle_events == recording.lifecycle_events


@pytest.mark.parametrize("path", RECORDINGS + RESPONSES, ids=lambda p: p.stem)
def test_lifecycle_events_are_numbered_from_zero_without_gaps(path: Path, tokenizer: Any) -> None:
    """Recorded and re-run alike, failures included: ``seq`` is 0, 1, 2, … in order."""
    recording = Recording.from_jsonl(path.read_bytes())
    for events in (recording.lifecycle_events, rerun_of(recording, tokenizer).lifecycle_events):
        assert [e.seq for e in events] == list(range(len(events)))


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda p: p.stem)
def test_recorded_outputs_match_the_spec(path: Path) -> None:
    recording = Recording.from_jsonl(path.read_bytes())
    if recording.status != 200:
        validate("ErrorResponse", orjson.loads(recording.output))
        return
    if recording.route == "/v1/chat/completions":
        if recording.body.get("stream"):
            for chunk in sse_payloads(recording.output):
                validate("CreateChatCompletionStreamResponse", chunk)
        else:
            validate("CreateChatCompletionResponse", orjson.loads(recording.output))
        return
    if recording.body.get("stream"):
        for chunk in sse_payloads(recording.output):
            for choice in chunk["choices"]:
                # Streamed chunks say ``finish_reason: null`` until the last one, as OpenAI
                # does, though the spec's shared schema has no null there.
                if choice["finish_reason"] is None:
                    choice["finish_reason"] = "stop"
            validate("CreateCompletionResponse", chunk)
    else:
        body = orjson.loads(recording.output)
        for choice in body["choices"]:
            lp = choice["logprobs"]
            if lp and recording.body.get("echo"):
                # echo's first prompt token has no logprob: OpenAI sends null.
                assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
                lp["token_logprobs"][0], lp["top_logprobs"][0] = 0.0, {}
        validate("CreateCompletionResponse", body)


@pytest.mark.parametrize(
    "path",
    [
        HERE / "completions/stream.jsonl",
        HERE / "chat/stream.jsonl",
        HERE / "responses/stream.jsonl",
    ],
    ids=lambda p: p.parent.name,
)
def test_replay_notices_a_changed_token(path: Path, tokenizer: Any) -> None:
    recording = Recording.from_jsonl(path.read_bytes())
    batches = recording.engine_batches
    for b, batch in enumerate(batches):
        for i, event in enumerate(batch):
            if isinstance(event, TokenSampled):
                batches[b][i] = dataclasses.replace(event, token_id=event.token_id + 1)
                break
        else:
            continue
        break
    _, output = replay(recording, tokenizer)
    assert output != recording.output


def test_stream_and_unary_recordings_agree() -> None:
    """The same greedy prompt, recorded streamed and unary: the accumulated stream
    text is the unary text."""
    stream = Recording.from_jsonl((HERE / "completions/stream.jsonl").read_bytes())
    unary = Recording.from_jsonl((HERE / "completions/unary.jsonl").read_bytes())
    text = "".join(c["choices"][0]["text"] for c in sse_payloads(stream.output) if c["choices"])
    assert text == orjson.loads(unary.output)["choices"][0]["text"]
    assert text.startswith(" Paris")


def test_chat_stream_and_unary_recordings_agree() -> None:
    stream = Recording.from_jsonl((HERE / "chat/stream.jsonl").read_bytes())
    unary = Recording.from_jsonl((HERE / "chat/unary.jsonl").read_bytes())
    chunks = [c for c in sse_payloads(stream.output) if c["choices"]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == orjson.loads(unary.output)["choices"][0]["message"]["content"]
    assert text == "The capital of France is Paris."


def test_replay_cli_reports_every_file() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "sluice.replay",
            str(HERE / "completions"),
            str(HERE / "chat"),
            str(HERE / "tools"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(RECORDINGS)} passed, 0 failed" in out.stdout

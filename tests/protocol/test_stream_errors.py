"""Failures after the first byte of a stream: one ``data: {"error": …}`` frame, then
the stream ends (no ``[DONE]``); before the first byte: a plain HTTP error. Driven
through the real routes with a scripted engine, no model."""

from __future__ import annotations

from typing import Any

import anyio
import orjson
import pytest

from sluice.events.recorder import Recording
from sluice.events.types import EngineEvent, PromptProcessed, SequenceFinished, TokenSampled
from sluice.http.routes import chat, completions
from sluice.pipeline.token_text import TokenTexts
from sluice.replay.cli import replay_recording
from tests.conftest import MODEL_NAME
from tests.support.openapi import validate


def scripted(route: str, body: dict[str, Any], batches: list[list[EngineEvent]]) -> Recording:
    return Recording(route, body, "req-1", 1_700_000_000, MODEL_NAME, 8192, engine_batches=batches)


def frames(raw: bytes) -> list[bytes]:
    return [f for f in raw.split(b"\n\n") if f]


def run(recording: Recording, tokenizer: Any) -> tuple[int, bytes]:
    from sluice.pipeline.chat import ChatSetup

    setup = ChatSetup.for_tokenizer(None, tokenizer)
    return anyio.run(replay_recording, recording, tokenizer, TokenTexts(tokenizer), setup)


def failing_batches(tokenizer: Any, prompt_len: int) -> list[list[EngineEvent]]:
    ids = tokenizer.encode(" Paris is")
    return [
        [PromptProcessed("req-1", 0, 0, prompt_len, 0), TokenSampled("req-1", 0, 1, ids[0])],
        [TokenSampled("req-1", 0, 2, ids[1])],
        [SequenceFinished("req-1", 0, 3, "abort", 2, error="engine error: out of memory")],
    ]


@pytest.mark.parametrize("route", [completions.ROUTE, chat.ROUTE])
def test_error_after_the_first_byte_is_one_error_frame(route: str, tokenizer: Any) -> None:
    if route == completions.ROUTE:
        body: dict[str, Any] = {"model": MODEL_NAME, "prompt": "The capital of France is"}
        prompt_len = len(tokenizer.encode(body["prompt"]))
    else:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]}
        prompt_len = len(
            tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
        )
    body |= {"stream": True, "max_tokens": 8, "temperature": 0}
    status, output = run(scripted(route, body, failing_batches(tokenizer, prompt_len)), tokenizer)
    assert status == 200
    sent = frames(output)
    assert b"[DONE]" not in output
    error = orjson.loads(sent[-1].removeprefix(b"data: "))
    validate("ErrorResponse", error)
    assert error["error"]["message"] == "engine error: out of memory"
    assert error["error"]["type"] == "server_error"
    text = "".join(
        (c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or "")
        for c in (orjson.loads(f.removeprefix(b"data: ")) for f in sent[:-1])
    )
    assert text == " Paris is"


def test_immediate_engine_failure_on_a_stream_is_its_one_error_frame(tokenizer: Any) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "stream": True,
    }
    batches: list[list[EngineEvent]] = [
        [SequenceFinished("req-1", 0, 0, "abort", 0, error="engine error: boom")]
    ]
    status, output = run(scripted(completions.ROUTE, body, batches), tokenizer)
    # The response had started (SSE headers are sent once the prompt is accepted), so
    # even an immediate engine failure arrives as the stream's one error frame.
    assert status == 200
    [frame] = frames(output)
    assert orjson.loads(frame.removeprefix(b"data: ")) == {
        "error": {
            "message": "engine error: boom",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }


def test_unary_engine_failure_is_a_500(tokenizer: Any) -> None:
    body = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 8}
    batches: list[list[EngineEvent]] = [
        [SequenceFinished("req-1", 0, 0, "abort", 0, error="engine error: boom")]
    ]
    status, output = run(scripted(completions.ROUTE, body, batches), tokenizer)
    assert status == 500
    body_out = orjson.loads(output)
    validate("ErrorResponse", body_out)
    assert body_out["error"]["message"] == "engine error: boom"

"""Each native tool-call and reasoning format, end to end through HTTP with the official
``openai`` SDK and no model: the recorded sessions (tests/recordings/tools, written by
``tests/make_tool_recordings.py``) are played to a live server, unary and streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from sluice.events.recorder import Recording
from sluice.http.app import create_app
from sluice.http.state import ServerState
from sluice.pipeline.chat import ChatSetup
from sluice.pipeline.runner import PipelineContext
from sluice.pipeline.token_text import TokenTexts
from sluice.replay.backend import QueuedReplayEngine
from tests.support.app_thread import serve
from tests.support.openapi import validate

TOOLS = Path(__file__).parents[1] / "recordings" / "tools"
CASES = sorted({p.stem.removeprefix("chatcmpl-").rsplit("-", 1)[0] for p in TOOLS.glob("*.jsonl")})
MODEL = "SmolLM2-135M-Instruct"


def load(name: str, kind: str) -> Recording:
    return Recording.from_jsonl((TOOLS / f"chatcmpl-{name}-{kind}.jsonl").read_bytes())


@pytest.fixture(scope="module")
def replayed(tokenizer: Any) -> Iterator[tuple[ServerState, QueuedReplayEngine, openai.OpenAI]]:
    engine = QueuedReplayEngine(8192)
    pipeline = PipelineContext(engine, tokenizer, TokenTexts(tokenizer), 8192)
    state = ServerState(pipeline, MODEL)
    with serve(create_app(state)) as url:
        yield state, engine, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def use(
    state: ServerState, engine: QueuedReplayEngine, recording: Recording, tokenizer: Any
) -> None:
    """Set the server up as the recording's server was, and queue its engine events."""
    flags = recording.server
    state.chat = ChatSetup.for_tokenizer(
        flags.get("chat_template"),
        tokenizer,
        tool_call_parser=flags.get("tool_call_parser"),
        reasoning_parser=flags.get("reasoning_parser"),
    )
    engine.push(recording.engine_batches)


def summary(message: dict[str, Any]) -> dict[str, Any]:
    """A message without its call ids (they derive from the request id, new per request)."""
    calls = message.get("tool_calls") or []
    return {
        "content": message.get("content") or "",
        "reasoning": message.get("reasoning_content"),
        "calls": [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls],
    }


def test_every_native_format_is_recorded() -> None:
    assert set(CASES) >= {
        "hermes", "llama3", "mistral", "deepseekv3", "deepseekv31", "pythonic", "kimi_k2",
        "glm45", "qwen3_coder", "qwen3-reasoning-then-call", "deepseek-r1-reasoning",
        "kimi-reasoning", "mistral-reasoning-truncated",
    }  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_unary_through_the_sdk(name: str, replayed: Any, tokenizer: Any) -> None:
    state, engine, client = replayed
    recording = load(name, "unary")
    use(state, engine, recording, tokenizer)
    completion = client.chat.completions.create(**recording.body)
    got = completion.model_dump(exclude_unset=True)
    validate("CreateChatCompletionResponse", orjson.loads(completion.to_json()))
    expected = orjson.loads(recording.output)
    assert [summary(c["message"]) for c in got["choices"]] == [
        summary(c["message"]) for c in expected["choices"]
    ]
    assert [c.finish_reason for c in completion.choices] == [
        c["finish_reason"] for c in expected["choices"]
    ]
    assert got["usage"] == expected["usage"]
    ids = [call.id for c in completion.choices for call in c.message.tool_calls or ()]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize("name", CASES)
def test_streamed_through_the_sdk_helper(name: str, replayed: Any, tokenizer: Any) -> None:
    """``chat.completions.stream()`` accumulates the streamed calls into what the unary
    response says, and every chunk keeps the streaming contract."""
    state, engine, client = replayed
    recording = load(name, "stream")
    use(state, engine, recording, tokenizer)
    body = {k: v for k, v in recording.body.items() if k != "stream"}
    unary = orjson.loads(load(name, "unary").output)
    chunks: list[dict[str, Any]] = []
    with client.chat.completions.stream(**body) as stream:
        for event in stream:
            if event.type == "chunk":
                chunks.append(orjson.loads(event.chunk.to_json()))
        # The helper refuses to "parse" a length-truncated completion; its snapshot is
        # the same accumulation.
        truncated = any(c["finish_reason"] == "length" for c in unary["choices"])
        final = stream.current_completion_snapshot if truncated else stream.get_final_completion()
    for chunk in chunks:
        validate("CreateChatCompletionStreamResponse", chunk)
        for choice in chunk["choices"]:
            entries = choice["delta"].get("tool_calls") or []
            indexes = [entry["index"] for entry in entries]
            assert len(indexes) == len(set(indexes)), "one entry per call index per chunk"
            for entry in entries:
                if "id" in entry:  # a call's first delta
                    assert entry["type"] == "function" and entry["function"]["arguments"] == ""
                else:
                    assert set(entry) == {"index", "function"}
                    assert set(entry["function"]) == {"arguments"}
    finishes: dict[int, int] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["finish_reason"] is not None:
                finishes[choice["index"]] = finishes.get(choice["index"], 0) + 1
    assert finishes == {c["index"]: 1 for c in unary["choices"]}
    got = final.model_dump()
    assert [summary(c["message"]) for c in got["choices"]] == [
        summary(c["message"]) for c in unary["choices"]
    ]
    assert [c.finish_reason for c in final.choices] == [
        c["finish_reason"] for c in unary["choices"]
    ]

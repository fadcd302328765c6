"""Responses lifecycles driven by scripted engine events (no model): an engine error
mid-stream (``error`` then ``response.failed``), reasoning items from a reasoning
parser, and the lifecycle trace lines."""

from __future__ import annotations

from typing import Any

import anyio
import orjson
import pytest
import structlog

from sluice.events.recorder import Recording
from sluice.events.types import EngineEvent, PromptProcessed, SequenceFinished, TokenSampled
from sluice.http.projections.responses import fold_events
from sluice.http.routes.responses import ResponsesService, run_responses
from sluice.http.store import SqliteResponseStore
from sluice.pipeline.chat import ChatSetup
from sluice.pipeline.token_text import TokenTexts
from sluice.replay.cli import replay_recording
from tests.conftest import MODEL_NAME
from tests.support.openapi import validate
from tests.support.responses_spec import check_response, check_stream, parse_sse

RID = "resp_00000000000000000000000000000001"


def batches_for(
    tokenizer: Any, text: str, *, end: str = "eos", prompt_len: int = 30
) -> list[list[EngineEvent]]:
    ids = tokenizer.encode(text)
    out: list[list[EngineEvent]] = [[PromptProcessed(RID, 0, 0, prompt_len, 0)]]
    out += [[TokenSampled(RID, 0, i + 1, t)] for i, t in enumerate(ids)]
    n = len(ids)
    if end == "eos":
        out.append([TokenSampled(RID, 0, n + 1, 2),
                    SequenceFinished(RID, 0, n + 2, "stop", n + 1, matched_token=2)])  # fmt: skip
    else:
        out.append([SequenceFinished(RID, 0, n + 1, "abort", n, error=end)])
    return out


def replay(
    tokenizer: Any, body: dict[str, Any], batches: list[list[EngineEvent]], **server: str
) -> tuple[int, bytes]:
    full = {"model": MODEL_NAME, **body}
    recording = Recording("/v1/responses", full, RID, 1_700_000_000, MODEL_NAME, 8192,
                          engine_batches=batches, server=dict(server))  # fmt: skip
    setup = ChatSetup.for_tokenizer(None, tokenizer)
    return anyio.run(replay_recording, recording, tokenizer, TokenTexts(tokenizer), setup)


def test_an_engine_error_mid_stream_is_error_then_failed(tokenizer: Any) -> None:
    batches = batches_for(tokenizer, " Paris is", end="engine error: out of memory")
    status, output = replay(tokenizer, {"input": "Hi", "stream": True}, batches)
    assert status == 200
    events = parse_sse(output)
    check_stream(events)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    error = events[-2]
    assert error["message"] == "engine error: out of memory" and error["param"] is None
    failed = events[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "engine error: out of memory"}
    [item] = failed["output"]
    assert item["status"] == "incomplete" and item["content"][0]["text"] == " Paris is"
    assert fold_events(events) == failed


def test_an_engine_error_on_a_unary_request_is_a_500(tokenizer: Any) -> None:
    batches = batches_for(tokenizer, " Paris", end="engine error: out of memory")
    status, output = replay(tokenizer, {"input": "Hi"}, batches)
    assert status == 500
    body = orjson.loads(output)
    validate("ErrorResponse", body)
    assert body["error"]["message"] == "engine error: out of memory"


def test_reasoning_becomes_a_reasoning_item_before_the_message(tokenizer: Any) -> None:
    batches = batches_for(tokenizer, "<think>Paris is in France.</think>The answer is Paris.")
    body = {"input": "Capital of France?", "stream": True, "reasoning": {"effort": "low"}}
    status, output = replay(tokenizer, body, batches, reasoning_parser="deepseek-r1")
    assert status == 200
    events = parse_sse(output)
    check_stream(events)
    kinds = [e["type"] for e in events]
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    final = events[-1]["response"]
    reasoning, message = final["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["summary"] == []
    assert reasoning["content"][0]["text"].strip() == "Paris is in France."
    assert message["content"][0]["text"].strip() == "The answer is Paris."
    assert final["reasoning"] == {"effort": "low", "summary": None}
    details = final["usage"]["output_tokens_details"]
    assert 0 < details["reasoning_tokens"] < final["usage"]["output_tokens"]
    assert fold_events(events) == final


def test_every_lifecycle_transition_is_traced_without_text(tokenizer: Any) -> None:
    batches = batches_for(tokenizer, " Paris.")
    with structlog.testing.capture_logs() as logs:
        status, _ = replay(tokenizer, {"input": "Secret question", "stream": True}, batches)
    assert status == 200
    lines = [line for line in logs if line["event"].startswith("response.")]
    assert [line["event"] for line in lines] == [
        "response.created",
        "response.in_progress",
        "response.first_token",
        "response.output_item.done",
        "response.completed",
    ]
    assert all(line["response_id"] == RID for line in lines)
    done = lines[-1]
    assert done["status"] == "completed" and done["output_tokens"] == 3
    assert done["input_tokens"] == 30 and done["seconds"] >= 0
    assert "Secret" not in repr(logs)


def test_trace_prompts_adds_the_text(tokenizer: Any) -> None:
    recording = Recording("/v1/responses", {"model": MODEL_NAME, "input": "Secret question"},
                          RID, 1_700_000_000, MODEL_NAME, 8192,
                          engine_batches=batches_for(tokenizer, " Paris."))  # fmt: skip

    async def go() -> None:
        from sluice.http.output import BufferOutput
        from sluice.http.state import ServerState
        from sluice.pipeline.runner import PipelineContext
        from sluice.replay.backend import ReplayEngine

        engine = ReplayEngine({RID: recording.engine_batches}, 8192)
        pipeline = PipelineContext(engine, tokenizer, TokenTexts(tokenizer), 8192)
        state = ServerState(pipeline, MODEL_NAME, chat=ChatSetup.for_tokenizer(None, tokenizer))
        service = ResponsesService(SqliteResponseStore(":memory:"), trace_prompts=True)
        await run_responses(state, recording.body, BufferOutput(), request_id=RID,
                            created=1, service=service)  # fmt: skip
        await service.close()

    with structlog.testing.capture_logs() as logs:
        anyio.run(go)
    created = next(line for line in logs if line["event"] == "response.created")
    assert {"role": "user", "content": "Secret question"} in created["input_text"]
    completed = next(line for line in logs if line["event"] == "response.completed")
    assert completed["output_text"] == " Paris."


def test_check_response_rejects_a_missing_echo() -> None:
    """The spec helper itself can fail: a Response without ``user`` is refused."""
    with pytest.raises(AssertionError):
        check_response({"id": "resp_1", "object": "response"})


def test_a_call_continued_after_text_fails_the_response_cleanly() -> None:
    """Output the stream cannot show (arguments for a call already closed) ends the
    response with ``error`` + ``response.failed``, numbered on, never a broken stream."""
    from sluice.events.types import Created, Delta, InProgress, ToolCall
    from sluice.http.projections.responses import ResponsesProjection, base_response
    from sluice.http.protocol.responses import parse_responses_request

    config = parse_responses_request({"model": "m", "input": "x"}).config()
    base = base_response(RID, 1, config, background=False)
    projection = ResponsesProjection(base, new_id=lambda p: f"{p}_{RID}", want_logprobs=False,
                                     clock=lambda: 2)  # fmt: skip
    events = projection.project(
        [Created(RID, -1, 0, 1, "m"), InProgress(RID, 0, 1, 3, 0),
         ToolCall(RID, 0, 2, 0, "call_1", "f", ""), ToolCall(RID, 0, 3, 0, None, None, '{"a"'),
         Delta(RID, 0, 4, "text", 1), ToolCall(RID, 0, 5, 0, None, None, ": 1}")]
    )  # fmt: skip
    check_stream(events)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["message"].startswith("internal error: tool call 0 continued")
    assert fold_events(events) == events[-1]["response"]

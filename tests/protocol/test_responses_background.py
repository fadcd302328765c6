"""Background responses through the real app over the fake engine, then bad bodies and tool
calls: queued, followed live and replayed, cancelled, refused."""

from __future__ import annotations

from typing import Any

import anyio
import orjson
import pytest

from sluice.http.routes.responses import ResponsesService
from sluice.http.store import SqliteResponseStore
from tests.support.fake_engine import MODEL, FakeEngine
from tests.support.responses_app import Client, get, post, run
from tests.support.responses_spec import check_response, check_stream, parse_sse

# ------------------------------------------------------------------------ background


def test_background_runs_after_the_answer_and_is_observable(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        queued = await post(client, {"input": "Hi", "max_output_tokens": 16, "background": True})
        statuses = [queued["status"]]
        body = queued
        while body["status"] in ("queued", "in_progress"):
            await anyio.sleep(0.005)
            body = await get(client, f"/v1/responses/{queued['id']}")
            statuses.append(body["status"])
        log = await get(client, f"/v1/responses/{queued['id']}?stream=true")
        return queued, statuses, body, log

    queued, statuses, final, log = run(tokenizer, step, step_s=0.005)
    assert queued["status"] == "queued" and queued["background"] is True
    assert queued["output"] == [] and queued["usage"] is None
    assert "in_progress" in statuses and statuses[-1] == "incomplete"
    check_response(final)
    check_stream(log)
    assert [e["type"] for e in log[:3]] == [
        "response.created", "response.queued", "response.in_progress",
    ]  # fmt: skip
    assert log[-1]["response"] == final


def test_cancel_a_background_response_stops_its_sequences(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        queued = await post(client, {"input": "Hi", "max_output_tokens": 4000, "background": True})
        rid = queued["id"]
        while (await get(client, f"/v1/responses/{rid}"))["status"] != "in_progress":  # noqa: ASYNC110
            await anyio.sleep(0.005)
        resp = await client.post(f"/v1/responses/{rid}/cancel")
        cancelled = await resp.json()
        again = await client.post(f"/v1/responses/{rid}/cancel")
        stored = await get(client, f"/v1/responses/{rid}")
        return resp.status, cancelled, again.status, stored, dict(engine.running), engine.cancelled

    status, cancelled, again, stored, running, cancels = run(tokenizer, step, step_s=0.01)
    assert status == 200 and cancelled["status"] == "cancelled"
    check_response(cancelled)
    assert again == 200  # cancelling a cancelled response returns it again
    assert stored == cancelled
    assert not running and cancels and cancels[0][0] == cancelled["id"]
    assert cancelled["output"] == [] or cancelled["output"][0]["status"] == "incomplete"


def test_cancel_is_only_for_background_responses(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        body = await post(client, {"input": "Hi", "max_output_tokens": 16})
        resp = await client.post(f"/v1/responses/{body['id']}/cancel")
        missing = await client.post("/v1/responses/resp_nope/cancel")
        return resp.status, await resp.json(), missing.status

    status, error, missing = run(tokenizer, step)
    assert status == 400 and error["error"]["message"] == "Cannot cancel a synchronous response."
    assert missing == 404


def test_a_follower_sees_a_background_stream_live(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        queued = await post(client, {"input": "Hi", "max_output_tokens": 64, "background": True})
        # Started while the response runs: replays what happened, then follows live.
        follower = await get(client, f"/v1/responses/{queued['id']}?stream=true&starting_after=1")
        stored = await get(client, f"/v1/responses/{queued['id']}?stream=true")
        return follower, stored

    follower, stored = run(tokenizer, step, step_s=0.005)
    assert follower == stored[2:]
    assert follower[-1]["type"] == "response.incomplete"
    check_stream(stored)


def test_background_with_stream_streams_the_run(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        events = await post(client, {"input": "Hi", "max_output_tokens": 16, "background": True,
                                     "stream": True})  # fmt: skip
        stored = await get(client, f"/v1/responses/{events[0]['response']['id']}?stream=true")
        return events, stored

    events, stored = run(tokenizer, step)
    check_stream(events)
    assert events == stored and events[0]["response"]["status"] == "queued"


def test_the_store_survives_a_new_app_on_the_same_file(tokenizer: Any, tmp_path: Any) -> None:
    path = tmp_path / "responses.sqlite3"

    async def first(client: Client, engine: FakeEngine) -> Any:
        return await post(client, {"input": "Hi", "max_output_tokens": 16})

    async def second(client: Client, engine: FakeEngine) -> Any:
        body = await get(client, f"/v1/responses/{stored['id']}")
        follow = await post(client, {"input": "More", "previous_response_id": stored["id"],
                                     "max_output_tokens": 16})  # fmt: skip
        return body, follow

    stored = run(tokenizer, first, service=ResponsesService(SqliteResponseStore(path)))
    body, follow = run(tokenizer, second, service=ResponsesService(SqliteResponseStore(path)))
    assert body == stored
    assert follow["usage"]["input_tokens"] > stored["usage"]["input_tokens"] + 16


def test_a_response_a_restart_interrupted_replays_to_its_failure(
    tokenizer: Any, tmp_path: Any
) -> None:
    """A background response a previous process left in progress: after the restart its
    stored log, replayed with ``?stream=true``, ends with ``response.failed`` carrying
    the stored error (numbered on from the log), and equals the retrieved body."""
    from sluice.events.types import Created, Delta, InProgress
    from sluice.http.projections.responses import ResponsesProjection, base_response
    from sluice.http.protocol.responses import parse_responses_request

    path, rid = tmp_path / "responses.sqlite3", "resp_interrupted"
    config = parse_responses_request({"model": MODEL, "input": "Hi", "background": True}).config()
    projection = ResponsesProjection(
        base_response(rid, 1, config, background=True),
        new_id=lambda prefix: f"{prefix}_{rid}",
        want_logprobs=False,
        clock=lambda: 2,
    )
    logged = projection.project(
        [Created(rid, -1, 0, 1, MODEL), InProgress(rid, 0, 1, 3, 0), Delta(rid, 0, 2, "la", 1)]
    )

    async def crashed() -> None:  # what the previous process had stored when it died
        store = SqliteResponseStore(path)
        body = orjson.dumps(projection.snapshot("in_progress"))
        await store.create(rid, created_at=1, status="in_progress", background=True, body=body,
                           history=[], input_items=[])  # fmt: skip
        await store.append_events(rid, [(e["sequence_number"], orjson.dumps(e)) for e in logged])
        await store.close()

    async def step(client: Client, engine: FakeEngine) -> Any:
        replayed = await get(client, f"/v1/responses/{rid}?stream=true")
        tail = await get(client, f"/v1/responses/{rid}?stream=true&starting_after=2")
        return replayed, tail, await get(client, f"/v1/responses/{rid}")

    anyio.run(crashed)
    replayed, tail, body = run(tokenizer, step, service=ResponsesService(SqliteResponseStore(path)))
    check_stream(replayed)
    assert replayed[:-1] == logged
    failed = replayed[-1]
    assert failed["type"] == "response.failed"
    assert failed["sequence_number"] == logged[-1]["sequence_number"] + 1
    assert failed["response"]["error"]["code"] == "server_error"
    assert failed["response"] == body and check_response(body)["status"] == "failed"
    assert tail == replayed[3:]


# ------------------------------------------------------------------------ bad bodies


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
            "input_image",
        ),
        ({"input": [{"type": "input_file", "file_id": "f"}]}, "input[0].type", "input_file"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
        (
            {"input": "x", "tools": [{"type": "code_interpreter"}]},
            "tools[0].type",
            "code_interpreter",
        ),
        ({"input": "x", "max_output_tokens": 8}, "max_output_tokens", "16"),
        ({"input": "x", "truncation": "middle"}, "truncation", "auto"),
        ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "16"),
        ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata", "512"),
        ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata", "64"),
        ({"input": "x", "top_logprobs": 3}, "top_logprobs", "include"),
        (
            {"input": "x", "top_logprobs": 21, "include": ["message.output_text.logprobs"]},
            "top_logprobs",
            "20",
        ),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include", "encrypted"),
        ({"input": "x", "background": True, "store": False}, "background", "store"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "conversation"),
        ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning.summary", "summar"),
        ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity", "low"),
        ({"input": "x", "service_tier": "flex"}, "service_tier", "flex"),
        (
            {"input": "x", "stream_options": {"include_obfuscation": True}, "stream": True},
            "stream_options.include_obfuscation",
            "obfuscation",
        ),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "Tools cannot be empty"),
        ({"input": "x", "colour": 1}, "colour", "colour"),
        ({"input": []}, "input", "empty"),
        ({}, "input", "input"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
            "input[0].arguments",
            "JSON object",
        ),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(
    tokenizer: Any, body: dict[str, Any], param: str, words: str
) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        return await post(client, body, 400), engine.submitted

    error, submitted = run(tokenizer, step)
    assert error["error"]["param"] == param
    assert words in error["error"]["message"]
    assert submitted == 0


def test_truncation_disabled_refuses_and_auto_drops_the_oldest(tokenizer: Any) -> None:
    long = "word " * 2000  # ~2000 tokens a message; the fake context is 8192

    async def step(client: Client, engine: FakeEngine) -> Any:
        items = [{"role": "user", "content": long + str(i)} for i in range(5)]
        refused = await post(client, {"input": items, "max_output_tokens": 16}, 400)
        kept = await post(client, {"input": items, "max_output_tokens": 16,
                                   "truncation": "auto"})  # fmt: skip
        return refused, kept

    refused, kept = run(tokenizer, step)
    assert refused["error"]["code"] == "context_length_exceeded"
    assert refused["error"]["param"] == "input"
    assert kept["truncation"] == "auto" and kept["status"] == "incomplete"
    assert 4000 < kept["usage"]["input_tokens"] <= 8192 - 16


def test_unknown_model_is_refused(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        resp = await client.post("/v1/responses", json={"model": "nope", "input": "x"})
        return resp.status, await resp.json()

    status, error = run(tokenizer, step)
    assert status == 400 and error["error"]["param"] == "model"


# ------------------------------------------------------------------------ tool calls

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "strict": False,
}


def scripted_call(tokenizer: Any, body: dict[str, Any], text: str) -> list[dict[str, Any]]:
    """The route over engine events that 'generate' ``text`` then the end of turn."""
    from sluice.events.recorder import Recording
    from sluice.events.types import PromptProcessed, SequenceFinished, TokenSampled
    from sluice.pipeline.chat import ChatSetup
    from sluice.pipeline.token_text import TokenTexts
    from sluice.replay.cli import replay_recording

    rid = "resp_0123456789abcdef0123456789abcdef"
    ids = tokenizer.encode(text)
    batches: list[list[Any]] = [[PromptProcessed(rid, 0, 0, 40, 0)]]
    batches += [[TokenSampled(rid, 0, i + 1, t)] for i, t in enumerate(ids)]
    batches.append(
        [TokenSampled(rid, 0, len(ids) + 1, 2),
         SequenceFinished(rid, 0, len(ids) + 2, "stop", len(ids) + 1, matched_token=2)]
    )  # fmt: skip
    recording = Recording("/v1/responses", {"model": MODEL, **body, "stream": True}, rid,
                          1_700_000_000, MODEL, 8192, engine_batches=batches)  # fmt: skip
    setup = ChatSetup.for_tokenizer(None, tokenizer)
    status, output = anyio.run(replay_recording, recording, tokenizer, TokenTexts(tokenizer), setup)
    assert status == 200, output
    events = parse_sse(output)
    check_stream(events)
    return events


def test_a_forced_call_is_a_function_call_item(tokenizer: Any) -> None:
    body = {"input": "Weather in Paris?", "tools": [WEATHER_TOOL], "tool_choice": "required"}
    events = scripted_call(
        tokenizer, body, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    )
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.delta" in kinds
    assert "response.content_part.added" not in kinds  # no message: only the call
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    [item] = final["output"]
    assert item["type"] == "function_call" and item["status"] == "completed"
    assert item["id"].startswith("fc_") and item["call_id"].startswith("call_")
    assert item["name"] == "get_weather"
    assert orjson.loads(item["arguments"]) == {"city": "Paris"}
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == item["arguments"] and done["name"] == "get_weather"
    assert final["tools"] == [{**WEATHER_TOOL}]
    assert final["tool_choice"] == "required"


def test_two_calls_are_two_items_and_max_tool_calls_keeps_the_first(tokenizer: Any) -> None:
    text = (
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    )
    body = {"input": "Weather?", "tools": [WEATHER_TOOL], "tool_choice": "required"}
    both = scripted_call(tokenizer, body, text)[-1]["response"]["output"]
    assert [orjson.loads(i["arguments"])["city"] for i in both] == ["Paris", "Rome"]
    assert len({i["call_id"] for i in both}) == 2 and len({i["id"] for i in both}) == 2
    one = scripted_call(tokenizer, {**body, "max_tool_calls": 1}, text)[-1]["response"]
    assert [orjson.loads(i["arguments"])["city"] for i in one["output"]] == ["Paris"]
    assert one["max_tool_calls"] == 1


def test_tool_request_validation(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        named = await post(client, {"input": "x", "tools": [WEATHER_TOOL],
                                    "tool_choice": {"type": "function", "name": "nope"}},
                           400)  # fmt: skip
        dup = await post(client, {"input": "x", "tools": [WEATHER_TOOL, WEATHER_TOOL]}, 400)
        bad_schema = await post(client, {"input": "x", "tools": [
            {**WEATHER_TOOL, "parameters": {"type": "nonsense"}}]}, 400)  # fmt: skip
        return named, dup, bad_schema

    named, dup, bad_schema = run(tokenizer, step)
    assert named["error"]["message"] == "Tool 'nope' not found in tools list."
    assert "unique" in dup["error"]["message"]
    assert bad_schema["error"]["param"] == "tools[0].parameters"


def test_text_format_json_schema_is_a_grammar_and_is_echoed(tokenizer: Any) -> None:
    fmt = {"type": "json_schema", "name": "city", "strict": True,
           "schema": {"type": "object", "properties": {"name": {"type": "string"}},
                      "required": ["name"], "additionalProperties": False}}  # fmt: skip

    async def step(client: Client, engine: FakeEngine) -> Any:
        body = await post(client, {"input": "x", "max_output_tokens": 16, "text": {"format": fmt}})
        obj = await post(client, {"input": "x", "max_output_tokens": 16,
                                  "text": {"format": {"type": "json_object"}}})  # fmt: skip
        no_schema = {"format": {"type": "json_schema", "name": "n"}}
        missing = await post(client, {"input": "x", "text": no_schema}, 400)
        return body, obj, missing

    body, obj, missing = run(tokenizer, step)
    assert body["text"]["format"] == fmt and obj["text"]["format"] == {"type": "json_object"}
    assert missing["error"]["param"] == "text.format.schema"

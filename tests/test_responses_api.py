"""``/v1/responses`` through the real app, routes, pipeline and store over the fake engine
(no model): create, stream, continue, retrieve, delete, background, cancel, replayed
and live ``GET ?stream=true``, input_items paging, and the errors. Every body and event
is checked against OpenAI's spec (``responses_spec``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from sluice.http.app import create_app
from sluice.http.routes.responses import ResponsesService
from sluice.http.store import SqliteResponseStore

from .fake_engine import MODEL, FakeEngine, fake_state
from .openapi import validate
from .responses_spec import check_response, check_stream, parse_sse

Client = TestClient[Any, Any]


@asynccontextmanager
async def app_client(
    tokenizer: Any,
    engine: FakeEngine,
    service: ResponsesService | None = None,
    api_keys: frozenset[str] = frozenset(),
) -> AsyncIterator[Client]:
    app = create_app(fake_state(tokenizer, engine), responses=service, api_keys=api_keys)
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


def run(
    tokenizer: Any,
    step: Callable[[Client, FakeEngine], Awaitable[Any]],
    *,
    step_s: float = 0.001,
    service: ResponsesService | None = None,
    api_keys: frozenset[str] = frozenset(),
) -> Any:
    async def go() -> Any:
        engine = FakeEngine(tokens=tokenizer.encode(" la"), step_s=step_s)
        async with app_client(tokenizer, engine, service, api_keys) as client:
            with anyio.fail_after(60):
                return await step(client, engine)

    return anyio.run(go)


async def post(client: Client, body: dict[str, Any], status: int = 200) -> Any:
    resp = await client.post("/v1/responses", json={"model": MODEL, **body})
    raw = await resp.read()
    assert resp.status == status, raw[:2000]
    if resp.content_type == "text/event-stream":
        return parse_sse(raw)
    data = orjson.loads(raw)
    if status == 200:
        check_response(data)
    else:
        validate("ErrorResponse", data)
    return data


async def get(client: Client, path: str, status: int = 200) -> Any:
    resp = await client.get(path)
    raw = await resp.read()
    assert resp.status == status, raw[:2000]
    if resp.content_type == "text/event-stream":
        return parse_sse(raw)
    return orjson.loads(raw)


def text_of(body: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in body["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


# --------------------------------------------------------------------------- create


def test_unary_create_runs_out_of_tokens_as_incomplete(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        body = {"input": "Sing", "max_output_tokens": 16, "user": "u1", "metadata": {"k": "v"}}
        return await post(client, {**body, "instructions": "Be brief."})

    body = run(tokenizer, step)
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["completed_at"] is None
    assert text_of(body) == " la" * 16
    [item] = body["output"]
    assert item["id"].startswith("msg_") and item["status"] == "incomplete"
    assert body["usage"]["output_tokens"] == 16
    assert body["usage"]["total_tokens"] == body["usage"]["input_tokens"] + 16
    assert body["usage"]["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}
    assert (body["user"], body["metadata"], body["instructions"]) == ("u1", {"k": "v"},
                                                                      "Be brief.")  # fmt: skip
    assert (body["store"], body["background"], body["truncation"]) == (True, False, "disabled")
    assert body["max_output_tokens"] == 16 and body["tools"] == [] and body["tool_choice"] == "auto"


def test_stream_is_the_events_and_the_stored_response_is_their_fold(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        events = await post(client, {"input": "Sing", "max_output_tokens": 16, "stream": True})
        stored = await get(client, f"/v1/responses/{events[0]['response']['id']}")
        replayed = await get(client, f"/v1/responses/{stored['id']}?stream=true")
        tail = await get(client, f"/v1/responses/{stored['id']}?stream=true&starting_after=5")
        return events, stored, replayed, tail

    events, stored, replayed, tail = run(tokenizer, step)
    check_stream(events)
    kinds = [e["type"] for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert (
        events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    )
    assert events[0]["response"]["usage"] is None
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == " la" * 16
    final = events[-1]["response"]
    assert stored == final
    check_response(stored)
    assert replayed == events  # the stored event log is the stream
    assert tail == events[6:]


def test_an_empty_answer_is_still_one_message(tokenizer: Any) -> None:
    from sluice.events.types import ChoiceFinished, Completed, Created, InProgress, Usage
    from sluice.http.projections.responses import ResponsesProjection, base_response

    base = base_response("resp_x", 1, {"model": "m"}, background=False)
    projection = ResponsesProjection(base, new_id=lambda p: f"{p}_1", want_logprobs=False,
                                     clock=lambda: 2)  # fmt: skip
    usage = Usage(3, 1)
    events = projection.project(
        [Created("resp_x", -1, 0, 1, "m"), InProgress("resp_x", 0, 1, 3, 0),
         ChoiceFinished("resp_x", 0, 2, "stop", 2, usage), Completed("resp_x", -1, 3, usage)]
    )  # fmt: skip
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["completed_at"] == 2
    assert final["output"][0]["content"][0]["text"] == ""


def test_items_input_and_previous_response_continue_the_conversation(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        first = await post(client, {"input": [
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        ], "max_output_tokens": 16})  # fmt: skip
        second = await post(client, {"input": "More", "previous_response_id": first["id"],
                                     "max_output_tokens": 16})  # fmt: skip
        listed = await get(client, f"/v1/responses/{second['id']}/input_items")
        listed_first = await get(client, f"/v1/responses/{first['id']}/input_items?order=asc")
        prompts = [len(s.prompt_ids) for s in []]
        return first, second, listed, listed_first, prompts, engine.prompt_tokens

    first, second, listed, listed_first, _, prompt_total = run(tokenizer, step)
    assert second["previous_response_id"] == first["id"]
    # The second prompt holds the first exchange: more input tokens than the first.
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + 16
    validate("ResponseItemList", listed)
    assert [i["content"][0]["text"] for i in listed["data"]] == ["More"]
    assert listed["has_more"] is False
    roles = [i["role"] for i in listed_first["data"]]
    assert roles == ["developer", "user"]
    assert all(i["id"].startswith("msg_") for i in listed_first["data"])
    assert prompt_total == first["usage"]["input_tokens"] + second["usage"]["input_tokens"]


def test_output_items_fed_back_and_item_reference(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        first = await post(client, {"input": "Hi", "max_output_tokens": 16})
        message = first["output"][0]
        again = await post(client, {"input": [
            {"role": "user", "content": "Hi"}, message,
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "42"},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "hmm"}]},
            {"role": "user", "content": "And?"},
        ], "max_output_tokens": 16})  # fmt: skip
        ref = await post(client, {"input": [{"type": "item_reference", "id": message["id"]},
                                            {"id": message["id"]},
                                            {"role": "user", "content": "Go"}],
                                  "max_output_tokens": 16})  # fmt: skip
        listed = await get(client, f"/v1/responses/{ref['id']}/input_items?order=asc")
        missing = await post(client, {"input": [{"type": "item_reference", "id": "msg_nope"}]},
                             404)  # fmt: skip
        return first, again, listed, missing

    first, again, listed, missing = run(tokenizer, step)
    assert again["status"] == "incomplete"
    validate("ResponseItemList", listed)
    assert [i["id"] for i in listed["data"][:2]] == [first["output"][0]["id"]] * 2
    assert listed["data"][0]["content"][0]["text"] == " la" * 16
    assert missing["error"]["param"] == "input[0].id"


def test_logprobs_are_included_when_asked(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        return await post(client, {"input": "Hi", "max_output_tokens": 16, "stream": True,
                                   "include": ["message.output_text.logprobs"],
                                   "top_logprobs": 2})  # fmt: skip

    events = run(tokenizer, step)
    check_stream(events)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert all(len(e["logprobs"]) == 1 for e in deltas)
    assert deltas[0]["logprobs"][0]["token"] == " la"
    part = events[-1]["response"]["output"][0]["content"][0]
    assert [lp["token"] for lp in part["logprobs"]] == [" la"] * 16
    assert events[-1]["response"]["top_logprobs"] == 2


# -------------------------------------------------------------------- the other routes


def test_retrieve_delete_and_not_found(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        body = await post(client, {"input": "Hi", "max_output_tokens": 16})
        got = await get(client, f"/v1/responses/{body['id']}")
        resp = await client.delete(f"/v1/responses/{body['id']}")
        deleted = (resp.status, await resp.json())
        gone = await get(client, f"/v1/responses/{body['id']}", 404)
        again = await client.delete(f"/v1/responses/{body['id']}")
        bad = await get(client, "/v1/responses/chatcmpl-1", 400)
        items_gone = await get(client, f"/v1/responses/{body['id']}/input_items", 404)
        prev = await post(client, {"input": "x", "previous_response_id": body["id"]}, 404)
        prev_bad = await post(client, {"input": "x", "previous_response_id": "abc"}, 400)
        return body, got, deleted, gone, again.status, bad, items_gone, prev, prev_bad

    body, got, deleted, gone, again, bad, items_gone, prev, prev_bad = run(tokenizer, step)
    assert got == body
    assert deleted == (200, {"id": body["id"], "object": "response", "deleted": True})
    for error in (gone, items_gone, prev):
        validate("ErrorResponse", error)
    assert gone["error"]["message"] == f"Response with id '{body['id']}' not found."
    assert again == 404
    assert bad["error"]["message"] == (
        "Invalid 'response_id': 'chatcmpl-1'. Expected an ID that begins with 'resp'."
    )
    assert prev["error"]["param"] == prev_bad["error"]["param"] == "previous_response_id"


def test_store_false_keeps_nothing(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        body = await post(client, {"input": "Hi", "max_output_tokens": 16, "store": False})
        return body, await get(client, f"/v1/responses/{body['id']}", 404)

    body, missing = run(tokenizer, step)
    assert body["store"] is False and missing["error"]["code"] is None


def test_input_items_pages_both_ways(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        items = [{"role": "user", "content": f"m{i}"} for i in range(5)]
        body = await post(client, {"input": items, "max_output_tokens": 16})
        base = f"/v1/responses/{body['id']}/input_items"
        pages = []
        after = None
        while True:
            page = await get(client, base + "?limit=2" + (f"&after={after}" if after else ""))
            validate("ResponseItemList", page)
            pages.append(page)
            if not page["has_more"]:
                break
            after = page["last_id"]
        asc = await get(client, base + "?order=asc&limit=100")
        bad_limit = await get(client, base + "?limit=0", 400)
        bad_order = await get(client, base + "?order=up", 400)
        bad_after = await get(client, base + "?after=msg_nope", 400)
        unknown = await get(client, base + "?colour=red", 400)
        return pages, asc, bad_limit, bad_order, bad_after, unknown

    pages, asc, *errors = run(tokenizer, step)
    texts = [i["content"][0]["text"] for p in pages for i in p["data"]]
    assert texts == ["m4", "m3", "m2", "m1", "m0"]  # newest first by default
    assert [len(p["data"]) for p in pages] == [2, 2, 1]
    assert [p["has_more"] for p in pages] == [True, True, False]
    assert pages[0]["first_id"] == pages[0]["data"][0]["id"]
    assert [i["content"][0]["text"] for i in asc["data"]] == ["m0", "m1", "m2", "m3", "m4"]
    assert [e["error"]["param"] for e in errors] == ["limit", "order", "after", "colour"]


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
    logged = projection.open() + projection.project(
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

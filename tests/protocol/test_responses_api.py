"""``/v1/responses`` through the real app, routes, pipeline and store over the fake engine
(no model): create, stream, continue, retrieve, delete, background, cancel, replayed
and live ``GET ?stream=true``, input_items paging, and the errors. Every body and event
is checked against OpenAI's spec (``responses_spec``)."""

from __future__ import annotations

from typing import Any

from tests.support.fake_engine import FakeEngine
from tests.support.openapi import validate
from tests.support.responses_app import Client, get, post, run
from tests.support.responses_spec import check_response, check_stream


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


CALL = {"type": "function_call", "call_id": "call_7", "name": "f", "arguments": "{}"}


def answer(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": "42"}


def test_a_tool_output_must_answer_a_call_it_follows(tokenizer: Any) -> None:
    """As OpenAI: an output whose call is neither in the previous response's
    conversation nor earlier in the input is a 400 naming the call id."""

    async def step(client: Client, engine: FakeEngine) -> Any:
        limit = {"max_output_tokens": 16}
        same_input = await post(client, {"input": [CALL, answer("call_7")], **limit})
        stray = await post(client, {"input": [answer("call_nope")]}, 400)
        before = await post(client, {"input": [answer("call_7"), CALL]}, 400)
        first = await post(client, {"input": [{"role": "user", "content": "Go"}, CALL], **limit})
        previous = {"previous_response_id": first["id"], **limit}
        continued = await post(client, {**previous, "input": [answer("call_7")]})
        unknown = await post(client, {**previous, "input": [answer("call_8")]}, 400)
        return same_input, stray, before, continued, unknown

    same_input, stray, before, continued, unknown = run(tokenizer, step)
    assert same_input["status"] == continued["status"] == "incomplete"  # ran to its limit
    for refused, call_id in ((stray, "call_nope"), (before, "call_7"), (unknown, "call_8")):
        validate("ErrorResponse", refused)
        assert refused["error"] == {
            "message": f"No tool call found for function call output with call_id {call_id}.",
            "type": "invalid_request_error",
            "param": "input",
            "code": None,
        }

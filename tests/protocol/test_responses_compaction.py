"""``POST /v1/responses/compact`` and compaction items given back, through the real
app, routes, pipeline and store over the fake engine: the body against OpenAI's
``CompactResource``, what is kept verbatim, the summary reaching the next prompt (over
HTTP and WebSocket), the item checked when it comes back (tampered at any position,
foreign, another model: a 400, never a crash), keys kept by the store across
restarts, and the request's own errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest

from sluice.http.errors import ApiError
from sluice.http.routes.responses import ResponsesService
from sluice.http.routes.responses.compaction_item import seal, unseal
from sluice.http.store import SqliteResponseStore
from tests.support.fake_engine import MODEL, FakeEngine
from tests.support.openapi import validate
from tests.support.responses_app import Client, app_client, get, post, run
from tests.support.responses_socket import final, one_response

CONVERSATION = [
    {"role": "user", "content": "My name is Ada."},
    {"type": "message", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": "Hello Ada.", "annotations": []}]},
    {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "42"},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on."}]},
]  # fmt: skip
SUMMARY = " la" * 256  # the fake engine's summary: max tokens of its token cycle


async def compact(client: Client, body: dict[str, Any], status: int = 200) -> Any:
    resp = await client.post("/v1/responses/compact", json=body)
    data = orjson.loads(await resp.read())
    assert resp.status == status, data
    validate("CompactResource" if status == 200 else "ErrorResponse", data)
    return data


def test_compaction_keeps_user_messages_and_seals_a_summary(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        return await compact(client, {"model": MODEL, "input": CONVERSATION})

    body = run(tokenizer, step)
    assert body["object"] == "response.compaction" and body["id"].startswith("resp_")
    *kept, item = body["output"]
    assert [m["content"][0]["text"] for m in kept] == ["My name is Ada.", "Go on."]
    assert all(m["role"] == "user" and m["id"].startswith("msg_") for m in kept)
    assert item["type"] == "compaction" and item["id"].startswith("cmp_")
    assert body["usage"]["output_tokens"] == 256
    assert body["usage"]["input_tokens"] > 30


def test_the_summary_reaches_the_next_prompt_over_http_and_websocket(tokenizer: Any) -> None:
    new_turn = {"role": "user", "content": "What is my name?"}

    async def step(client: Client, engine: FakeEngine) -> Any:
        output = (await compact(client, {"model": MODEL, "input": CONVERSATION}))["output"]
        resumed = await post(client, {"input": [*output, new_turn], "max_output_tokens": 16})
        without = await post(client, {"input": [*output[:-1], new_turn], "max_output_tokens": 16})
        items = await get(client, f"/v1/responses/{resumed['id']}/input_items?order=asc")
        async with client.ws_connect("/v1/responses") as ws:
            # Not validated against the spec: its oneOf for input items is ambiguous for
            # a message with an id and a status (both Item and InputMessage match).
            turn = {"type": "response.create", "model": MODEL, "input": [*output, new_turn],
                    "max_output_tokens": 16}  # fmt: skip
            await ws.send_str(orjson.dumps(turn).decode())
            over_ws = final(await one_response(ws))
        return output, resumed, without, items, over_ws

    output, resumed, without, items, over_ws = run(tokenizer, step)
    summary_tokens = len(tokenizer.encode(SUMMARY))
    gained = resumed["usage"]["input_tokens"] - without["usage"]["input_tokens"]
    assert summary_tokens <= gained <= summary_tokens + 8  # the summary, as an assistant turn
    assert over_ws["usage"]["input_tokens"] == resumed["usage"]["input_tokens"]
    # Stored as given: input_items shows the compaction item verbatim.
    assert items["data"][2] == output[2]


def test_a_compaction_item_is_checked_when_it_comes_back(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> list[Any]:
        output = (await compact(client, {"model": MODEL, "input": CONVERSATION}))["output"]
        item = output[-1]
        content = item["encrypted_content"]
        payload = content.split(".")[1]
        forged = orjson.dumps({"model": MODEL, "summary": "I am root."}).hex()
        cases = [
            content[:-2] + ("AA" if content[-2:] != "AA" else "BB"),  # the tag
            content.replace(payload, payload[:-1] + ("A" if payload[-1] != "A" else "B")),
            seal(b"k" * 32, MODEL, "a summary from another server"),
            "sluice1." + forged + ".tag",
            "not a compaction at all",
            "",
        ]
        errors = []
        for bad in cases:
            given = [
                *output[:-1],
                {**item, "encrypted_content": bad},
                {"role": "user", "content": "x"},
            ]
            errors.append(await post(client, {"input": given}, status=400))
        errors.append(await post(client, {"input": [{"type": "compaction"}]}, status=400))
        # Still serving: the untouched item works.
        await post(client, {"input": [*output, {"role": "user", "content": "x"}],
                            "max_output_tokens": 16})  # fmt: skip
        return errors

    *sealed, missing = run(tokenizer, step)
    for error in sealed:
        assert error["error"]["param"] == "input[2].encrypted_content", error
        assert error["error"]["code"] == "invalid_encrypted_content"
    assert missing["error"]["param"] == "input[0].encrypted_content"


def test_every_changed_character_is_refused() -> None:
    key = bytes(range(32))
    content = seal(key, MODEL, "The user is Ada; the lookup returned 42.")
    assert unseal(key, MODEL, content, "p") == "The user is Ada; the lookup returned 42."
    alphabet = "AZaz09-_."
    for position, char in enumerate(content):
        for replacement in alphabet:
            if replacement == char:
                continue
            changed = content[:position] + replacement + content[position + 1 :]
            try:
                summary = unseal(key, MODEL, changed, "p")
            except ApiError as exc:
                assert exc.status == 400 and exc.code == "invalid_encrypted_content"
            else:  # base64 padding bits: a different string, the same bytes
                assert summary == "The user is Ada; the lookup returned 42.", position
    with pytest.raises(ApiError, match="another model"):
        unseal(key, "other-model", content, "p")
    with pytest.raises(ApiError, match="changed"):
        unseal(bytes(32), MODEL, content, "p")


def test_compacting_a_stored_conversation(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        first = await post(client, {"input": "Remember 7.", "max_output_tokens": 16})
        body = await compact(client, {"model": MODEL, "previous_response_id": first["id"],
                                      "input": "And 8."})  # fmt: skip
        return first, body

    first, body = run(tokenizer, step)
    *kept, item = body["output"]
    assert [m["content"][0]["text"] for m in kept] == ["Remember 7.", "And 8."]
    assert kept[0]["id"] == first["id"].replace("resp_", "msg_") + "0000"
    assert item["type"] == "compaction"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "x"}, 400, "model"),
        ({"model": "other", "input": "x"}, 400, "model"),
        ({"model": MODEL}, 400, "input"),
        ({"model": MODEL, "input": []}, 400, "input"),
        ({"model": MODEL, "input": "x", "store": True}, 400, "store"),
        ({"model": MODEL, "input": "x", "prompt_cache_key": ""}, 400, "prompt_cache_key"),
        (
            {"model": MODEL, "input": "x", "prompt_cache_retention": "24h"},
            400,
            "prompt_cache_retention",
        ),
        ({"model": MODEL, "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ],
)
def test_compact_request_errors(
    tokenizer: Any, body: dict[str, Any], status: int, param: str
) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        return await compact(client, body, status=status)

    assert run(tokenizer, step)["error"]["param"] == param


def test_the_key_lives_in_the_store(tokenizer: Any, tmp_path: Path) -> None:
    """A file store keeps the key across restarts; a server on another store refuses
    the item as foreign."""
    db = tmp_path / "responses.db"

    async def go() -> tuple[Any, Any, Any]:
        engine = FakeEngine(tokens=tokenizer.encode(" la"))
        service = ResponsesService(SqliteResponseStore(db))
        async with app_client(tokenizer, engine, service) as client:
            output = (await compact(client, {"model": MODEL, "input": "Hi."}))["output"]
        given = {"input": [*output, {"role": "user", "content": "x"}], "max_output_tokens": 16}
        restarted = ResponsesService(SqliteResponseStore(db))
        async with app_client(tokenizer, engine, restarted) as client:
            after_restart = await post(client, given)
        async with app_client(tokenizer, engine, None) as client:
            foreign = await post(client, given, status=400)
        return output, after_restart, foreign

    _, after_restart, foreign = anyio.run(go)
    assert after_restart["status"] == "completed" or after_restart["status"] == "incomplete"
    assert "share this store" in foreign["error"]["message"]

"""WebSocket mode (``GET /v1/responses`` upgraded) through the real app, routes,
pipeline and store over the fake engine, with aiohttp's WebSocket client: sequential
turns, ``store: false`` continuations remembered by the connection (and forgotten on
a reconnect or a failed continuation), lanes, the refusals and limits, auth, and what
closing the socket or the server does. Every client event sent is valid against the
spec's ``ResponsesClientEventResponseCreate``; every server event against
``ResponsesServerEvent`` or ``ResponseWsError``."""

from __future__ import annotations

from typing import Any

import anyio
import orjson
import pytest
from aiohttp import WSMsgType, WSServerHandshakeError
from aiohttp.test_utils import TestClient, TestServer

from sluice.http.app import create_app
from sluice.http.projections.responses import TERMINAL_EVENTS
from sluice.http.routes.responses import websocket
from tests.support.fake_engine import MODEL, FakeEngine, fake_state
from tests.support.openapi import validate
from tests.support.responses_app import Client, run
from tests.support.responses_socket import (
    create,
    error_of,
    final,
    one_response,
    receive,
)
from tests.support.responses_spec import check_stream

KEY = "sk-websocket-test"


def test_sequential_responses_on_one_connection(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> None:
        async with client.ws_connect("/v1/responses") as ws:
            ids = []
            for text in ("One", "Two", "Three"):
                await ws.send_str(orjson.dumps(create(text)).decode())
                events = await one_response(ws)
                response = final(events)
                assert response["status"] == "incomplete"  # max_output_tokens reached
                assert response["output"][0]["content"][0]["text"] == " la" * 16
                ids.append(response["id"])
            assert len(set(ids)) == 3
            # Stored (store defaults to true): readable over HTTP like any response.
            stored = await (await client.get(f"/v1/responses/{ids[1]}")).json()
            assert stored["id"] == ids[1] and stored["status"] == "incomplete"

    run(tokenizer, step)


def test_store_false_continuation_uses_only_the_new_input(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> None:
        async with client.ws_connect("/v1/responses") as ws:
            await ws.send_str(orjson.dumps(create("My name is Ada.", store=False)).decode())
            first = final(await one_response(ws))
            await ws.send_str(orjson.dumps(create("What is it?", store=False)).decode())
            fresh = final(await one_response(ws))
            await ws.send_str(
                orjson.dumps(
                    create("What is it?", store=False, previous_response_id=first["id"])
                ).decode()
            )
            continued = final(await one_response(ws))
            assert continued["previous_response_id"] == first["id"]
            # The continued prompt holds the first turn (input and output) as well.
            gained = continued["usage"]["input_tokens"] - fresh["usage"]["input_tokens"]
            assert gained >= first["usage"]["input_tokens"] - 5 > 0
            # A chain of store: false turns goes on from the newest.
            await ws.send_str(
                orjson.dumps(
                    create("And again?", store=False, previous_response_id=continued["id"])
                ).decode()
            )
            third = final(await one_response(ws))
            assert third["usage"]["input_tokens"] > continued["usage"]["input_tokens"]
        # Nothing was stored: over HTTP the response does not exist.
        resp = await client.post(
            "/v1/responses",
            json={"model": MODEL, "input": "x", "previous_response_id": first["id"]},
        )
        body = await resp.json()
        assert resp.status == 404 and body["error"]["code"] == "previous_response_not_found"

    run(tokenizer, step)


def test_a_new_connection_remembers_nothing(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> None:
        async with client.ws_connect("/v1/responses") as ws:
            await ws.send_str(orjson.dumps(create(store=False)).decode())
            first = final(await one_response(ws))
        async with client.ws_connect("/v1/responses") as ws:
            await ws.send_str(
                orjson.dumps(create(store=False, previous_response_id=first["id"])).decode()
            )
            error = await error_of(ws)
            assert error["status"] == 404
            assert error["error"]["code"] == "previous_response_not_found"
            assert error["error"]["param"] == "previous_response_id"
            # The connection stays usable: a clean new response works.
            await ws.send_str(orjson.dumps(create(store=False)).decode())
            assert final(await one_response(ws))["status"] == "incomplete"

    run(tokenizer, step)


def test_a_failed_continuation_forgets_what_it_continued(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> None:
        async with client.ws_connect("/v1/responses") as ws:
            await ws.send_str(orjson.dumps(create(store=False)).decode())
            first = final(await one_response(ws))
            bad = {**create(store=False, previous_response_id=first["id"]), "temperature": 5}
            await ws.send_str(orjson.dumps(bad).decode())
            error = await error_of(ws)
            assert (error["status"], error["error"]["param"]) == (400, "temperature")
            retry = create(store=False, previous_response_id=first["id"])
            await ws.send_str(orjson.dumps(retry).decode())
            error = await error_of(ws)
            assert error["error"]["code"] == "previous_response_not_found"

    run(tokenizer, step)


def test_a_stray_tool_output_fails_the_turn_and_evicts_what_it_continued(
    tokenizer: Any,
) -> None:
    """The Open Responses ``websocket-failed-continuation-evicts-cache`` case: a turn
    answering a call the previous response never made is a 400, and the connection's
    ``store: false`` entry for that response is gone, so a retry is not found."""
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}

    def output(call_id: str) -> dict[str, Any]:
        return {"type": "function_call_output", "call_id": call_id, "output": "42"}

    async def step(client: Client, engine: FakeEngine) -> None:
        async with client.ws_connect("/v1/responses") as ws:
            await ws.send_str(orjson.dumps(create(store=False, input=[call])).decode())
            first = final(await one_response(ws))
            then = {"store": False, "previous_response_id": first["id"]}
            answered = create(**then, input=[output("call_1")])
            await ws.send_str(orjson.dumps(answered).decode())
            assert final(await one_response(ws))["status"] == "incomplete"  # its token limit
            stray = create(**then, input=[output("call_2")])
            await ws.send_str(orjson.dumps(stray).decode())
            error = await error_of(ws)
            assert (error["status"], error["error"]["param"]) == (400, "input")
            assert "call_id call_2" in error["error"]["message"]
            await ws.send_str(orjson.dumps(answered).decode())
            error = await error_of(ws)
            assert error["error"]["code"] == "previous_response_not_found"

    run(tokenizer, step)


def test_stored_continuations_read_the_store(tokenizer: Any) -> None:
    """A stored response is continued from the store, on any connection, and a DELETE
    reaches it: the connection keeps no copy of stored responses."""

    async def step(client: Client, engine: FakeEngine) -> None:
        async with client.ws_connect("/v1/responses") as ws:
            await ws.send_str(orjson.dumps(create()).decode())
            first = final(await one_response(ws))
        async with client.ws_connect("/v1/responses") as ws:
            await ws.send_str(orjson.dumps(create(previous_response_id=first["id"])).decode())
            assert final(await one_response(ws))["previous_response_id"] == first["id"]
            assert (await client.delete(f"/v1/responses/{first['id']}")).status == 200
            await ws.send_str(orjson.dumps(create(previous_response_id=first["id"])).decode())
            assert (await error_of(ws))["error"]["code"] == "previous_response_not_found"

    run(tokenizer, step)


def test_lanes_run_concurrently_and_in_order_within_each(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> None:
        async with client.ws_connect("/v1/responses") as ws:
            for lane in ("a", "b"):
                for text in ("first", "second"):
                    event = create(text, stream_id=lane, max_output_tokens=24)
                    await ws.send_str(orjson.dumps(event).decode())
            events = []
            while sum(e["type"] in TERMINAL_EVENTS for e in events) < 4:
                events.append(await receive(ws))
        by_lane: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
        for event in events:
            by_lane[event["stream_id"]].append(event)
        for lane_events in by_lane.values():
            kinds = [e["type"] for e in lane_events]
            # FIFO within a lane: the second response starts after the first ends.
            first_end = next(i for i, k in enumerate(kinds) if k in TERMINAL_EVENTS)
            assert kinds[first_end + 1] == "response.created"
            assert "response.created" not in kinds[1:first_end]
            check_stream(
                [
                    {k: v for k, v in e.items() if k != "stream_id"}
                    for e in lane_events[: first_end + 1]
                ]
            )
        # Concurrent across lanes: lane b started before lane a's first response ended.
        a_end = next(
            i
            for i, e in enumerate(events)
            if e["stream_id"] == "a" and e["type"] in TERMINAL_EVENTS
        )
        b_start = next(i for i, e in enumerate(events) if e["stream_id"] == "b")
        assert b_start < a_end

    run(tokenizer, step, step_s=0.01)


@pytest.mark.parametrize(
    ("message", "status", "param", "code"),
    [
        ({"type": "response.steer", "input": "x"}, 400, "type", "unsupported_event_type"),
        ({"model": MODEL, "input": "x"}, 400, "type", "unsupported_event_type"),
        ({**create(), "stream_id": "bad lane!"}, 400, "stream_id", None),
        ({**create(), "background": True}, 400, "background", None),
        ({**create(), "stream": False}, 400, "stream", None),
        ({**create(), "model": "other"}, 400, "model", "model_not_found"),
        ({**create(), "unknown_field": 1}, 400, "unknown_field", None),
        ({**create(), "generate": False}, 400, "generate", None),
    ],
)
def test_refusals_are_error_events_and_the_connection_stays(
    tokenizer: Any, message: dict[str, Any], status: int, param: str, code: str | None
) -> None:
    async def step(client: Client, engine: FakeEngine) -> None:
        async with client.ws_connect("/v1/responses") as ws:
            await ws.send_str(orjson.dumps(message).decode())
            error = await error_of(ws)
            assert error["status"] == status
            assert error["error"]["param"] == param
            assert error["error"]["code"] == code
            if message.get("stream_id") == "bad lane!":
                assert "stream_id" not in error  # not a lane: nothing to echo
            await ws.send_str(orjson.dumps(create()).decode())
            assert final(await one_response(ws))["status"] == "incomplete"

    run(tokenizer, step)


def test_malformed_messages(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> None:
        async with client.ws_connect("/v1/responses") as ws:
            await ws.send_str("{not json")
            assert "Invalid JSON" in (await error_of(ws))["error"]["message"]
            await ws.send_str("[1, 2]")
            assert (await error_of(ws))["status"] == 400
            await ws.send_bytes(orjson.dumps(create()))
            assert "text message" in (await error_of(ws))["error"]["message"]
            await ws.send_str(orjson.dumps({**create(), "stream_id": "lane-1"}).decode())
            events = await one_response(ws)
            assert {e["stream_id"] for e in events} == {"lane-1"}

    run(tokenizer, step)


def test_lane_and_pending_limits(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(websocket, "MAX_LANES", 2)
    monkeypatch.setattr(websocket, "MAX_PENDING", 3)

    async def step(client: Client, engine: FakeEngine) -> None:
        async with client.ws_connect("/v1/responses") as ws:
            for lane in ("a", "b", "c"):
                await ws.send_str(orjson.dumps(create(stream_id=lane)).decode())
            error = await error_of(ws)
            assert error["stream_id"] == "c"
            assert error["error"]["code"] == "websocket_stream_limit_reached"
            await ws.send_str(orjson.dumps(create(stream_id="a")).decode())  # pending: 3
            await ws.send_str(orjson.dumps(create(stream_id="b")).decode())
            error = await error_of(ws)
            assert (error["status"], error["error"]["code"]) == (429, "rate_limit_exceeded")
            assert error["error"]["headers"]["Retry-After"]
            done = 0
            while done < 3:
                done += (await receive(ws))["type"] in TERMINAL_EVENTS
            # Once they finished, the lanes take turns again.
            await ws.send_str(orjson.dumps(create(stream_id="b")).decode())
            assert final(await one_response(ws))["status"] == "incomplete"

    run(tokenizer, step, step_s=0.02)


def test_idle_lanes_close(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lane limit counts lanes with work: a lane per turn, one after another, never
    reaches it."""
    monkeypatch.setattr(websocket, "MAX_LANES", 2)

    async def step(client: Client, engine: FakeEngine) -> None:
        async with client.ws_connect("/v1/responses") as ws:
            for n in range(5):
                await ws.send_str(orjson.dumps(create(stream_id=f"lane-{n}")).decode())
                events = await one_response(ws)
                assert {e["stream_id"] for e in events} == {f"lane-{n}"}

    run(tokenizer, step)


def test_a_turn_that_fails_inside_reports_it(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that cannot be reached (a ``ConnectionError`` that is not the client's) is
    a 500 event for that turn; the connection goes on."""
    calls = 0
    real = websocket.run_responses

    async def flaky(*args: Any, **kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionRefusedError("the store is down")
        await real(*args, **kwargs)

    monkeypatch.setattr(websocket, "run_responses", flaky)

    async def step(client: Client, engine: FakeEngine) -> None:
        async with client.ws_connect("/v1/responses") as ws:
            await ws.send_str(orjson.dumps(create()).decode())
            assert (await error_of(ws))["status"] == 500
            await ws.send_str(orjson.dumps(create()).decode())
            assert final(await one_response(ws))["status"] == "incomplete"

    run(tokenizer, step)


def test_message_rate_limit(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(websocket, "MESSAGES_PER_S", 0.001)
    monkeypatch.setattr(websocket, "MESSAGE_BURST", 2.0)

    async def step(client: Client, engine: FakeEngine) -> None:
        async with client.ws_connect("/v1/responses") as ws:
            for _ in range(3):
                await ws.send_str("{}")
            kinds = [(await error_of(ws))["error"]["code"] for _ in range(3)]
            assert kinds == ["unsupported_event_type", "unsupported_event_type",
                             "rate_limit_exceeded"]  # fmt: skip

    run(tokenizer, step)


def test_message_size_limit(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import sluice.http.app as app_module

    monkeypatch.setattr(app_module, "MAX_BODY_BYTES", 4096)

    async def step(client: Client, engine: FakeEngine) -> None:
        async with client.ws_connect("/v1/responses") as ws:
            await ws.send_str(orjson.dumps(create("x" * 5000)).decode())
            message = await ws.receive()
            assert message.type is WSMsgType.CLOSE
            assert message.data == 1009  # message too big

    run(tokenizer, step)


def test_auth_as_on_http(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> None:
        with pytest.raises(WSServerHandshakeError) as refused:
            await client.ws_connect("/v1/responses")
        assert refused.value.status == 401
        with pytest.raises(WSServerHandshakeError) as wrong:
            await client.ws_connect("/v1/responses", headers={"Authorization": "Bearer nope"})
        assert wrong.value.status == 401
        headers = {"Authorization": f"Bearer {KEY}"}
        async with client.ws_connect("/v1/responses", headers=headers) as ws:
            await ws.send_str(orjson.dumps(create()).decode())
            assert final(await one_response(ws))["status"] == "incomplete"

    run(tokenizer, step, api_keys=frozenset({KEY}))


def test_plain_get_asks_for_an_upgrade(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> None:
        resp = await client.get("/v1/responses")
        body = await resp.json()
        assert resp.status == 426 and resp.headers["Upgrade"] == "websocket"
        validate("ErrorResponse", body)

    run(tokenizer, step)


def test_closing_the_socket_cancels_its_running_response(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> None:
        ws = await client.ws_connect("/v1/responses")
        await ws.send_str(orjson.dumps(create(max_output_tokens=2000)).decode())
        created = await receive(ws)
        response_id = created["response"]["id"]
        while (await receive(ws))["type"] != "response.output_text.delta":
            pass
        await ws.close()
        with anyio.fail_after(10):
            while True:
                stored = await (await client.get(f"/v1/responses/{response_id}")).json()
                if stored["status"] == "cancelled":
                    break
                await anyio.sleep(0.02)
        assert not engine.running
        assert engine.cancelled and engine.cancelled[0][0] == response_id

    run(tokenizer, step)


def test_server_shutdown_closes_open_sockets(tokenizer: Any) -> None:
    async def go() -> None:
        engine = FakeEngine(tokens=tokenizer.encode(" la"))
        client = TestClient(TestServer(create_app(fake_state(tokenizer, engine))))
        await client.start_server()
        ws = await client.ws_connect("/v1/responses")
        await ws.send_str(orjson.dumps(create()).decode())
        await one_response(ws)
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(client.server.close)
                message = await ws.receive()
        assert message.type is WSMsgType.CLOSE and message.data == 1001
        await client.close()

    anyio.run(go)

"""Two front ends (two apps over fake engines, no model) sharing one PostgreSQL store,
as two Sluice servers behind SGLang's gateway do: a background response one runs is
followed to its end through the other (``GET ?stream=true``), and cancelled through
the other (the cancel is relayed to the runner and confirmed in the store). A cancel
with no runner to confirm it (its front end gone) is a 503, never a hang."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from sluice.http.app import create_app
from sluice.http.routes.responses import SERVICE_KEY, ResponsesService
from sluice.http.routes.responses.elsewhere import follow_logged
from sluice.http.store import PostgresResponseStore
from tests.support.fake_engine import MODEL, FakeEngine, fake_state
from tests.support.responses_spec import check_response, check_stream, parse_sse

Client = TestClient[Any, Any]


@asynccontextmanager
async def front_end(tokenizer: Any, dsn: str, owner: str) -> AsyncIterator[Client]:
    engine = FakeEngine(tokens=tokenizer.encode(" la"), step_s=0.02)
    store = await PostgresResponseStore.connect(dsn, owner=owner)
    app = create_app(fake_state(tokenizer, engine), responses=ResponsesService(store))
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


def two_front_ends(
    tokenizer: Any, dsn: str, step: Callable[[Client, Client], Awaitable[Any]]
) -> Any:
    async def go() -> Any:
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(front_end(tokenizer, dsn, "a"))
            b = await stack.enter_async_context(front_end(tokenizer, dsn, "b"))
            return await step(a, b)

    return anyio.run(go)


def store_of(client: Client) -> Any:
    return client.app[SERVICE_KEY].store


async def start_background(client: Client, max_output_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "input": "Sing", "background": True,
            "max_output_tokens": max_output_tokens}  # fmt: skip
    resp = await client.post("/v1/responses", json=body)
    assert resp.status == 200
    return dict(await resp.json())


async def sse(client: Client, path: str) -> list[dict[str, Any]]:
    resp = await client.get(path)
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    return parse_sse(await resp.read())


def test_another_front_end_follows_a_running_response_to_its_end(
    tokenizer: Any, postgres_db: str
) -> None:
    async def step(a: Client, b: Client) -> Any:
        queued = await start_background(a, 40)  # 40 tokens at 20 ms: still running
        rid = queued["id"]
        elsewhere, here = (
            await sse(b, f"/v1/responses/{rid}?stream=true"),
            await sse(a, f"/v1/responses/{rid}?stream=true"),
        )
        tail = await sse(b, f"/v1/responses/{rid}?stream=true&starting_after=5")
        final = await (await b.get(f"/v1/responses/{rid}")).json()
        return elsewhere, here, tail, final

    elsewhere, here, tail, final = two_front_ends(tokenizer, postgres_db, step)
    check_stream(elsewhere)
    assert elsewhere == here
    assert elsewhere[-1]["type"] == "response.incomplete"
    assert elsewhere[-1]["response"] == check_response(final)
    assert tail == elsewhere[6:]


def test_a_cancel_through_another_front_end_reaches_the_runner(
    tokenizer: Any, postgres_db: str
) -> None:
    async def step(a: Client, b: Client) -> Any:
        queued = await start_background(a, 2000)
        rid = queued["id"]
        with anyio.fail_after(30):  # until the runner has started it
            async for logged in follow_logged(store_of(b), rid, -1):
                if any(orjson.loads(e)["type"] == "response.in_progress" for e in logged):
                    break
        cancelled = await b.post(f"/v1/responses/{rid}/cancel")
        body = orjson.loads(await cancelled.read())
        logged = await sse(b, f"/v1/responses/{rid}?stream=true")
        return cancelled.status, body, logged

    status, body, logged = two_front_ends(tokenizer, postgres_db, step)
    assert status == 200, body
    assert check_response(body)["status"] == "cancelled"
    # A cancel has no terminal stream event: following the log ends with what it holds.
    assert logged[0]["type"] == "response.created"
    assert not {"response.completed", "response.incomplete"} & {e["type"] for e in logged}


def test_a_cancel_nobody_confirms_is_a_503(
    tokenizer: Any, postgres_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner's front end is gone (its row says in progress, nobody listens)."""
    from sluice.http.routes.responses import elsewhere as responses_elsewhere

    async def step(a: Client, b: Client) -> Any:
        store = await PostgresResponseStore.connect(postgres_db, owner="gone")
        body = orjson.dumps({"id": "resp_orphan", "status": "in_progress"})
        await store.create("resp_orphan", created_at=1, status="in_progress", background=True,
                           body=body, history=[], input_items=[])  # fmt: skip
        await store.close()
        resp = await b.post("/v1/responses/resp_orphan/cancel")
        return resp.status, resp.headers.get("Retry-After"), await resp.json()

    monkeypatch.setattr(responses_elsewhere, "CANCEL_WAIT_S", 0.5)
    status, retry_after, error = two_front_ends(tokenizer, postgres_db, step)
    assert status == 503 and retry_after is not None
    assert "did not confirm the cancel" in error["error"]["message"]

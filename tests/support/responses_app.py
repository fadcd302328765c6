"""The real app over the fake engine, for ``/v1/responses`` tests: a client, a runner
that builds both, and POST / GET helpers that check every body against the spec."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import orjson
from aiohttp.test_utils import TestClient, TestServer

from sluice.http.app import create_app
from sluice.http.routes.responses import ResponsesService
from tests.support.fake_engine import MODEL, FakeEngine, fake_state
from tests.support.openapi import validate
from tests.support.responses_spec import check_response, parse_sse

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

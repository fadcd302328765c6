"""The real aiohttp app, routes and pipeline over a fake engine: fast, model-free
checks of HTTP behaviour (and the fixture other HTTP tests build on)."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from sluice.http.app import create_app

from .fake_engine import MODEL, FakeEngine, fake_state


@pytest.fixture
def engine(tokenizer: Any) -> FakeEngine:
    return FakeEngine(tokens=tokenizer.encode(" la"))


async def _client(tokenizer: Any, engine: FakeEngine) -> TestClient[Any, Any]:
    client = TestClient(TestServer(create_app(fake_state(tokenizer, engine))))
    await client.start_server()
    return client


def test_completion_over_the_fake_engine(tokenizer: Any, engine: FakeEngine) -> None:
    import anyio

    async def go() -> dict[str, Any]:
        client = await _client(tokenizer, engine)
        try:
            resp = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "Sing", "max_tokens": 3}
            )
            assert resp.status == 200
            body: dict[str, Any] = await resp.json()
            return body
        finally:
            await client.close()

    body = anyio.run(go)
    assert body["choices"][0]["text"] == " la la la"
    assert body["usage"]["completion_tokens"] == 3
    assert engine.submitted == 1 and not engine.running

"""The real aiohttp app, routes and pipeline over a fake engine: fast, model-free
checks of HTTP behaviour (and the fixture other HTTP tests build on)."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from sluice.http.app import create_app
from tests.support.fake_engine import MODEL, FakeEngine, fake_state


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


@pytest.mark.parametrize("stream", [True, False])
def test_a_recording_keeps_exactly_the_bytes_the_client_got(
    tokenizer: Any, engine: FakeEngine, tmp_path: Any, stream: bool
) -> None:
    """Streamed bytes are gathered and handed to the recording once, when the request
    ends; a unary body is recorded as sent. Either way the file replays to them."""
    import anyio

    from sluice.events.recorder import FileRecorder, Recording
    from sluice.pipeline.chat import ChatSetup
    from sluice.pipeline.token_text import TokenTexts
    from sluice.replay.cli import replay_recording

    state = fake_state(tokenizer, engine)
    state.recorder = FileRecorder(tmp_path)

    async def go() -> bytes:
        client = TestClient(TestServer(create_app(state)))
        await client.start_server()
        try:
            body = {"model": MODEL, "prompt": "Sing", "max_tokens": 5, "stream": stream}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status == 200
            return await resp.read()
        finally:
            await client.close()

    received = anyio.run(go)
    [path] = list(tmp_path.glob("*.jsonl"))
    recording = Recording.from_jsonl(path.read_bytes())
    assert recording.output == received
    assert received.count(b"data: ") == (6 if stream else 0)  # a chunk a token, [DONE]
    setup = ChatSetup.for_tokenizer(None, tokenizer)
    replayed = anyio.run(replay_recording, recording, tokenizer, TokenTexts(tokenizer), setup)
    assert replayed == (200, received)

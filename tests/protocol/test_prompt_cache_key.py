"""``prompt_cache_key`` (and, without it, ``user``) on every generating route: accepted,
handed to the engine as each sequence's routing key (what ``--dp-size`` routes by),
echoed by Responses; through the real app over the fake engine."""

from __future__ import annotations

from typing import Any

from tests.support.fake_engine import MODEL, FakeEngine
from tests.support.responses_app import Client, post, run

KEY = "conversation-42"


async def _post(client: Client, path: str, body: dict[str, Any]) -> Any:
    resp = await client.post(path, json={"model": MODEL, **body})
    assert resp.status == 200, await resp.text()
    return await resp.json()


def test_every_route_hands_the_key_to_the_engine(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        messages = [{"role": "user", "content": "Hi"}]
        await _post(
            client,
            "/v1/chat/completions",
            {"messages": messages, "max_tokens": 2, "prompt_cache_key": KEY},
        )
        await _post(
            client,
            "/v1/chat/completions",
            {"messages": messages, "max_tokens": 2, "user": "u-1", "n": 2},
        )
        await _post(
            client,
            "/v1/completions",
            {"prompt": "Hi", "max_tokens": 2, "prompt_cache_key": KEY, "user": "u-1"},
        )
        await _post(client, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        created = await post(
            client, {"input": "Hi", "max_output_tokens": 16, "prompt_cache_key": KEY}
        )
        compacted = await _post(
            client, "/v1/responses/compact", {"input": "Hi", "prompt_cache_key": KEY}
        )
        return engine.routing_keys, created, compacted

    keys, created, compacted = run(tokenizer, step)
    # chat (key), chat n=2 (user), completions (the key wins over user), completions
    # (neither), Responses, and the compaction's own summary run.
    assert keys == [KEY, "u-1", "u-1", KEY, None, KEY, KEY]
    assert created["prompt_cache_key"] == KEY
    assert compacted["object"] == "response.compaction"

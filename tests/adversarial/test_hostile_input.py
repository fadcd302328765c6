"""Hostile and broken input, model-free: the real app, routes and pipeline over the fake
engine. Every refusal is a 4xx in OpenAI's error envelope naming the parameter where there
is one, and the server goes on serving."""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from sluice.http.app import MAX_BODY_BYTES, create_app
from sluice.http.json_body import MAX_DEPTH, decode_json_body
from sluice.http.protocol.chat import MAX_MESSAGES
from sluice.http.protocol.common import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPLATE_KWARGS_BYTES,
)
from sluice.http.protocol.completions import MAX_CHOICES
from sluice.pipeline.chat import ChatSetup
from sluice.pipeline.chat_template import ChatTemplate
from tests.support.fake_engine import MODEL, FakeEngine, fake_state
from tests.support.openapi import validate

pytestmark = pytest.mark.anyio

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
COMPLETION = {"model": MODEL, "prompt": "Sing", "max_tokens": 2}
MESSAGES = [{"role": "user", "content": "Sing"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # aiohttp runs on asyncio only


@pytest.fixture
async def client(tokenizer: Any) -> AsyncIterator[TestClient[Any, Any]]:
    engine = FakeEngine(tokens=tokenizer.encode(" la"))
    client = TestClient(TestServer(create_app(fake_state(tokenizer, engine))))
    await client.start_server()
    try:
        yield client
    finally:
        # Whatever a test sent, the server still serves.
        resp = await client.post(COMPLETIONS, json=COMPLETION)
        assert resp.status == 200, await resp.text()
        await client.close()


async def post_raw(
    client: TestClient[Any, Any],
    path: str,
    data: bytes,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    resp = await client.post(
        path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    body: dict[str, Any] = orjson.loads(await resp.read())
    return resp.status, body


def error_of(status: int, body: dict[str, Any], expected_status: int = 400) -> dict[str, Any]:
    """The error object, once the envelope is checked against OpenAI's spec."""
    assert status == expected_status, body
    validate("ErrorResponse", body)
    error: dict[str, Any] = body["error"]
    assert error["type"] == "invalid_request_error"
    return error


# ------------------------------------------------------------------------- the body itself


async def test_invalid_utf8(client: TestClient[Any, Any]) -> None:
    raw = b'{"model": "' + MODEL.encode() + b'", "prompt": "caf\xe9"}'
    error = error_of(*await post_raw(client, COMPLETIONS, raw))
    assert "UTF-8" in error["message"] and "0xe9" in error["message"]


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (b'{"model": "m", "prompt": "a", "prompt": "b"}', "prompt"),
        (b'{"model": "m", "stream_options": {"include_usage": true, "include_usage": false}}',
         "include_usage"),
        (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", '
         b'"text": "a", "text": "b"}]}]}', "text"),
    ],
)  # fmt: skip
async def test_duplicate_keys_at_any_depth(
    client: TestClient[Any, Any], raw: bytes, key: str
) -> None:
    error = error_of(*await post_raw(client, CHAT, raw))
    assert error["param"] == key
    assert f"Duplicate key '{key}'" in error["message"]


def nested(levels: int) -> bytes:
    """A chat body whose deepest value sits ``levels`` levels down (the body is level 1)."""
    inner = b"[" * (levels - 2) + b"]" * (levels - 2)
    return b'{"model": "m", "messages": [], "chat_template_kwargs": {"x": ' + inner + b"}}"


def test_depth_limit_is_exact() -> None:
    decode_json_body(nested(MAX_DEPTH))  # {} then {"x": [...]} : exactly MAX_DEPTH levels
    with pytest.raises(Exception, match="nested deeper") as raised:
        decode_json_body(nested(MAX_DEPTH + 1))
    assert getattr(raised.value, "param", None) == "chat_template_kwargs"


@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, 5_000, 1_000_000])
async def test_deep_nesting(client: TestClient[Any, Any], levels: int) -> None:
    error = error_of(*await post_raw(client, CHAT, nested(levels)))
    assert f"nested deeper than {MAX_DEPTH} levels" in error["message"]


@pytest.mark.parametrize(
    ("raw", "got"),
    [(b"[]", "array"), (b'"text"', "string"), (b"42", "integer"), (b"null", "null")],
)
async def test_top_level_must_be_an_object(
    client: TestClient[Any, Any], raw: bytes, got: str
) -> None:
    error = error_of(*await post_raw(client, COMPLETIONS, raw))
    assert f"must be a JSON object, got {got}" in error["message"]


@pytest.mark.parametrize(
    "raw", [b"", b"   ", b'{"model": "m",', b"\xef\xbb\xbf{}", b'{"model": NaN}', b"{'a': 1}"]
)
async def test_not_json(client: TestClient[Any, Any], raw: bytes) -> None:
    error = error_of(*await post_raw(client, COMPLETIONS, raw))
    assert "JSON" in error["message"] or "empty" in error["message"]


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
async def test_wrong_content_type(client: TestClient[Any, Any], content_type: str) -> None:
    resp = await client.post(
        COMPLETIONS, data=orjson.dumps(COMPLETION), headers={"Content-Type": content_type}
    )
    error = error_of(resp.status, orjson.loads(await resp.read()))
    assert content_type in error["message"]


async def test_body_over_the_limit(client: TestClient[Any, Any]) -> None:
    raw = b'{"model": "m", "prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'
    error_of(*await post_raw(client, COMPLETIONS, raw), expected_status=413)


async def test_compressed_body_over_the_limit(client: TestClient[Any, Any]) -> None:
    """A gzip bomb: the limit applies to the decompressed body."""
    raw = b'{"model": "m", "prompt": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}'
    bomb = zlib.compress(raw, 1)
    assert len(bomb) < MAX_BODY_BYTES // 100
    status, body = await post_raw(client, COMPLETIONS, bomb, {"Content-Encoding": "deflate"})
    error_of(status, body, expected_status=413)


# -------------------------------------------------------------- values that parse, badly


@pytest.mark.parametrize(
    ("field", "raw_value", "param"),
    [
        ("seed", b"18446744073709551616", "seed"),
        ("seed", b"-9223372036854775809", "seed"),
        ("n", b"1000000000000000000000000000000", "n"),
        ("max_tokens", b"1e400", "max_tokens"),
        ("temperature", b"1e400", "temperature"),
        ("top_p", b"-1e400", "top_p"),
        ("logit_bias", b'{"13": 1e400}', "logit_bias"),
        ("n", b"2.5", "n"),
        ("max_tokens", b'"5"', "max_tokens"),
        ("temperature", b'"0.5"', "temperature"),
        ("seed", b'"1"', "seed"),
        ("n", b"true", "n"),
        ("logit_bias", b'{"13": "1"}', "logit_bias"),
        ("stop_token_ids", b'["2"]', "stop_token_ids"),
        ("prompt", b'"\\ud800 lone surrogate"', "prompt"),
        ("prompt", b'["ok", "\\udfff"]', "prompt[1]"),
    ],
)
async def test_bad_values_name_the_parameter(
    client: TestClient[Any, Any], field: str, raw_value: bytes, param: str
) -> None:
    """Written as raw JSON: these values do not survive a round trip through Python's."""
    fields = {"model": orjson.dumps(MODEL), "prompt": b'"Sing"', "max_tokens": b"1"}
    fields[field] = raw_value
    raw = b"{" + b", ".join(orjson.dumps(k) + b": " + v for k, v in fields.items()) + b"}"
    error = error_of(*await post_raw(client, COMPLETIONS, raw))
    assert error["param"] == param, error


async def test_a_surrogate_pair_is_fine(client: TestClient[Any, Any]) -> None:
    raw = b'{"model": "' + MODEL.encode() + b'", "prompt": "\\ud83d\\ude00", "max_tokens": 1}'
    status, body = await post_raw(client, COMPLETIONS, raw)
    assert status == 200, body


# ------------------------------------------------------------------------- routes


@pytest.mark.parametrize("path", ["/v1/no-such-route", "/no-such-route", "/v1/completions/x"])
async def test_unknown_route_is_404(client: TestClient[Any, Any], path: str) -> None:
    resp = await client.get(path)
    error = error_of(resp.status, orjson.loads(await resp.read()), expected_status=404)
    assert path in error["message"]


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", COMPLETIONS, "POST"),
        ("PUT", CHAT, "POST"),
        ("POST", "/v1/models", "GET"),
        ("DELETE", f"/v1/models/{MODEL}", "GET"),
    ],
)
async def test_wrong_method_is_405_with_allow(
    client: TestClient[Any, Any], method: str, path: str, allowed: str
) -> None:
    resp = await client.request(method, path)
    error = error_of(resp.status, orjson.loads(await resp.read()), expected_status=405)
    assert method in error["message"]
    assert allowed in {m.strip() for m in resp.headers["Allow"].split(",")}


# ------------------------------------------------------------------ resource limits


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt": ["a"] * 33, "n": 128}, "n"),  # 4224 choices
        ({"prompt": ["a"] * (MAX_CHOICES // 20 + 1), "best_of": 20}, "best_of"),
        ({"prompt": ["a"] * (MAX_CHOICES + 1)}, "n"),
        ({"stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop_token_ids": [2] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ],
)
async def test_completion_limits(
    client: TestClient[Any, Any], extra: dict[str, Any], param: str
) -> None:
    status, body = await post_raw(client, COMPLETIONS, orjson.dumps(COMPLETION | extra))
    assert error_of(status, body)["param"] == param


async def test_choices_at_the_limit_are_accepted(client: TestClient[Any, Any]) -> None:
    body = COMPLETION | {"prompt": ["a"] * 32, "n": 128, "max_tokens": 1}
    status, answer = await post_raw(client, COMPLETIONS, orjson.dumps(body))
    assert status == 200, answer
    assert len(answer["choices"]) == MAX_CHOICES


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"messages": MESSAGES * (MAX_MESSAGES + 1)}, "messages"),
        ({"chat_template_kwargs": {"d": "x" * MAX_TEMPLATE_KWARGS_BYTES}}, "chat_template_kwargs"),
        ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop"),
        ({"n": 129}, "n"),
        ({"max_tokens": 10**6}, "max_tokens"),  # beyond the context
    ],
)  # fmt: skip
async def test_chat_limits(client: TestClient[Any, Any], extra: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "messages": MESSAGES} | extra
    status, answer = await post_raw(client, CHAT, orjson.dumps(body))
    assert error_of(status, answer)["param"] == param


async def test_a_template_that_raises_is_a_400_with_its_message(tokenizer: Any) -> None:
    source = (
        "{% if messages[0].role == 'system' %}"
        "{{ raise_exception('No system messages, please') }}"
        "{% endif %}{{ messages[0].content }}"
    )
    state = fake_state(tokenizer, FakeEngine(tokens=tokenizer.encode(" la")))
    state.chat = ChatSetup(ChatTemplate(source), frozenset(), ())
    client = TestClient(TestServer(create_app(state)))
    await client.start_server()
    try:
        messages = [{"role": "system", "content": "Be brief"}, *MESSAGES]
        body = {"model": MODEL, "messages": messages, "max_tokens": 1}
        error = error_of(*await post_raw(client, CHAT, orjson.dumps(body)))
        assert "No system messages, please" in error["message"]
        status, answer = await post_raw(client, CHAT, orjson.dumps(body | {"messages": MESSAGES}))
        assert status == 200, answer
    finally:
        await client.close()

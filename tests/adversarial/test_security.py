"""The HTTP edge's security, model-free: the real app and routes over the fake engine.

API keys (a 401 envelope decided before routing and before the body is read),
CORS, request ids and the access log, and TLS with a CA made in the test and the
``openai`` SDK trusting it; then the start-up errors of the security flags.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import structlog
import trustme
from aiohttp.test_utils import TestClient, TestServer
from cryptography.hazmat.primitives import serialization

from sluice.http.app import MAX_BODY_BYTES, create_app
from sluice.http.middleware import ConfigError, parse_origins, read_api_keys, tls_context
from tests.conftest import REPO
from tests.support.fake_engine import MODEL, FakeEngine, fake_state

pytestmark = pytest.mark.anyio

KEY = "sk-sluice-test-7f3a9c"
KEYS = frozenset({KEY})
ORIGIN = "https://app.example"
COMPLETION = {"model": MODEL, "prompt": "Sing", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Sing"}], "max_tokens": 2}

# Every kind of route: real ones, an unknown /v1 route, wrong methods, an unknown
# route outside /v1 (only /health and /metrics are public).
PROTECTED = [
    ("GET", "/v1/models"),
    ("GET", f"/v1/models/{MODEL}"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/no-such-route"),
    ("GET", "/v1/completions"),
    ("DELETE", "/v1/models"),
    ("POST", "/no-such-route"),
]
BAD_AUTHORIZATION = [
    None,
    "Bearer sk-wrong",
    f"Bearer {KEY}x",
    f"Bearer {KEY[:-1]}",
    "Basic dXNlcjpwYXNz",
    f"Basic {KEY}",
    "Bearer",
    "Bearer   ",
    KEY,
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # aiohttp runs on asyncio only


@asynccontextmanager
async def serve(
    tokenizer: Any,
    *,
    api_keys: frozenset[str] = frozenset(),
    allowed_origins: tuple[str, ...] = (),
    ssl_context: ssl.SSLContext | None = None,
) -> AsyncIterator[TestClient[Any, Any]]:
    engine = FakeEngine(tokens=tokenizer.encode(" la"))
    app = create_app(
        fake_state(tokenizer, engine), api_keys=api_keys, allowed_origins=allowed_origins
    )
    server = TestServer(app)
    # No aiohttp access log, as in `sluice`: the structlog line replaces it.
    await server.start_server(ssl=ssl_context, access_log=None)
    client = TestClient(server)
    try:
        await client.start_server()
        yield client
    finally:
        await client.close()


def bearer(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def request(
    client: TestClient[Any, Any], method: str, path: str, headers: dict[str, str]
) -> aiohttp.ClientResponse:
    body = CHAT if path.endswith("chat/completions") else COMPLETION
    resp = await client.request(
        method, path, json=body if method == "POST" else None, headers=headers
    )
    await resp.read()
    return resp


def assert_invalid_api_key(status: int, body: Any) -> None:
    assert status == 401
    assert body == {
        "error": {
            "message": body["error"]["message"],
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    assert KEY not in body["error"]["message"] and "sk-wrong" not in body["error"]["message"]


# API keys


async def test_every_route_needs_the_key_before_routing(tokenizer: Any) -> None:
    async with serve(tokenizer, api_keys=KEYS) as client:
        for method, path in PROTECTED:
            for authorization in BAD_AUTHORIZATION:
                headers = {} if authorization is None else {"Authorization": authorization}
                resp = await request(client, method, path, headers)
                assert_invalid_api_key(resp.status, await resp.json())
                assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        # With the key, routing decides: 404 and 405 come back as usual.
        assert (await request(client, "GET", "/v1/no-such-route", bearer())).status == 404
        assert (await request(client, "GET", "/v1/completions", bearer())).status == 405


async def test_the_right_key_is_served(tokenizer: Any) -> None:
    async with serve(tokenizer, api_keys=KEYS) as client:
        for method, path in PROTECTED[:4]:
            assert (await request(client, method, path, bearer())).status == 200
        # The scheme is case-insensitive (RFC 7235); surrounding spaces do not matter.
        for value in (f"bearer {KEY}", f"BEARER  {KEY} "):
            resp = await request(client, "GET", "/v1/models", {"Authorization": value})
            assert resp.status == 200


async def test_openai_sdk_with_the_right_and_a_wrong_key(tokenizer: Any) -> None:
    async with serve(tokenizer, api_keys=KEYS) as client:
        base = str(client.make_url("/v1"))
        async with openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as sdk:
            assert [m.id for m in (await sdk.models.list()).data] == [MODEL]
            out = await sdk.completions.create(model=MODEL, prompt="Sing", max_tokens=3)
            assert out.choices[0].text == " la la la"
            stream = await sdk.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Sing"}],
                max_tokens=2,
                stream=True,
            )
            assert [c async for c in stream]
        async with openai.AsyncOpenAI(base_url=base, api_key="sk-wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError) as caught:
                await bad.completions.create(model=MODEL, prompt="Sing", max_tokens=3)
        assert caught.value.status_code == 401
        assert caught.value.code == "invalid_api_key"
        assert caught.value.request_id  # the SDK reads x-request-id


def test_api_key_file_parser(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# team keys\n\n  sk-one  \nsk-two\n   # sk-commented\n\n")
    assert read_api_keys(None, str(keys)) == {"sk-one", "sk-two"}
    assert read_api_keys(KEY, str(keys)) == {KEY, "sk-one", "sk-two"}
    assert read_api_keys(KEY, None) == KEYS
    assert read_api_keys(None, None) == frozenset()
    with pytest.raises(ConfigError, match="empty"):
        read_api_keys("  ", None)  # `--api-key "$UNSET"` must not start an open server
    with pytest.raises(ConfigError, match="cannot read"):
        read_api_keys(None, str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("# nothing yet\n\n")
    with pytest.raises(ConfigError, match="holds no key"):
        read_api_keys(KEY, str(tmp_path / "empty"))


async def test_keys_from_a_file_and_the_flag_all_work(tokenizer: Any, tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("sk-one\n# sk-commented\nsk-two\n")
    async with serve(tokenizer, api_keys=read_api_keys(KEY, str(tmp_path / "keys"))) as client:
        for key in (KEY, "sk-one", "sk-two"):
            assert (await request(client, "GET", "/v1/models", bearer(key))).status == 200
        for key in ("# sk-commented", "sk-commented", "sk-one sk-two"):
            assert (await request(client, "GET", "/v1/models", bearer(key))).status == 401


async def test_health_and_metrics_stay_public(tokenizer: Any) -> None:
    async with serve(tokenizer, api_keys=KEYS) as client:
        for method, path in [("GET", "/health"), ("HEAD", "/health"), ("GET", "/metrics")]:
            assert (await request(client, method, path, {})).status == 200


async def test_no_key_configured_is_open(tokenizer: Any) -> None:
    async with serve(tokenizer) as client:
        for headers in ({}, bearer("anything"), {"Authorization": "Basic eDp5"}):
            assert (await request(client, "GET", "/v1/models", headers)).status == 200
            assert (await request(client, "POST", "/v1/completions", headers)).status == 200
        assert (await request(client, "GET", "/v1/no-such-route", {})).status == 404


async def test_the_body_is_not_read_before_the_key_check(tokenizer: Any) -> None:
    never = asyncio.Event()

    async def endless_body() -> AsyncIterator[bytes]:
        yield b'{"model": '
        await never.wait()  # a server that read the body would wait forever

    oversized = b"x" * (MAX_BODY_BYTES + 1)
    async with serve(tokenizer, api_keys=KEYS) as client:
        resp = await asyncio.wait_for(client.post("/v1/completions", data=endless_body()), 10)
        assert_invalid_api_key(resp.status, await resp.json())
        for body, content_type in [(oversized, "application/json"), (b"{nope", "text/plain")]:
            resp = await client.post(
                "/v1/completions", data=body, headers={"Content-Type": content_type}
            )
            assert_invalid_api_key(resp.status, await resp.json())
    async with serve(tokenizer) as client:  # the same bodies do reach parsing without keys
        for body, content_type, status in [
            (oversized, "application/json", 413),
            (b"{nope", "text/plain", 400),
        ]:
            headers = {"Content-Type": content_type}
            resp = await client.post("/v1/completions", data=body, headers=headers)
            assert resp.status == status


async def test_keys_never_reach_the_logs(tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with structlog.testing.capture_logs() as logs:
        async with serve(tokenizer, api_keys=KEYS) as client:
            await request(client, "GET", f"/v1/models?api_key={KEY}", bearer())
            await request(client, "POST", "/v1/completions", bearer(KEY + "-wrong"))
            await request(client, "GET", "/v1/no-such-route", bearer())
            await request(client, "POST", "/v1/completions", {"Authorization": f"Basic {KEY}"})
    assert KEY not in repr(logs) and KEY not in caplog.text
    access = [e for e in logs if e["event"] == "request"]
    assert [(e["method"], e["path"], e["status"]) for e in access] == [
        ("GET", "/v1/models", 200),
        ("POST", "/v1/completions", 401),
        ("GET", "/v1/no-such-route", 404),
        ("POST", "/v1/completions", 401),
    ]
    for event in access:
        assert event.keys() >= {"duration_ms", "request_id", "client", "user_agent"}
        assert event["client"] == "127.0.0.1"


# CORS


async def test_cors_preflight_is_answered_without_a_key(tokenizer: Any) -> None:
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-trace, bad header",
    }
    async with serve(tokenizer, api_keys=KEYS, allowed_origins=(ORIGIN,)) as client:
        resp = await client.options("/v1/chat/completions", headers=preflight)
        assert resp.status == 204
        assert resp.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert "POST" in resp.headers["Access-Control-Allow-Methods"]
        allowed = [h.strip() for h in resp.headers["Access-Control-Allow-Headers"].split(",")]
        assert allowed == ["Authorization", "Content-Type", "x-trace"]
        assert int(resp.headers["Access-Control-Max-Age"]) > 0
        assert "Origin" in resp.headers.getall("Vary")
        assert resp.headers["X-Request-Id"]

        resp = await client.options(
            "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"}
        )
        assert resp.status != 204
        assert not any(h.startswith("Access-Control-") for h in resp.headers)


async def test_cors_headers_on_simple_requests(tokenizer: Any) -> None:
    async with serve(tokenizer, api_keys=KEYS, allowed_origins=(ORIGIN,)) as client:
        origin = {"Origin": ORIGIN}
        for path, headers, status in [
            ("/v1/models", {**origin, **bearer()}, 200),
            ("/v1/models", origin, 401),  # the page can read why it failed
        ]:
            resp = await request(client, "GET", path, headers)
            assert resp.status == status
            assert resp.headers["Access-Control-Allow-Origin"] == ORIGIN
            assert resp.headers["Access-Control-Expose-Headers"] == "X-Request-Id"
            assert "Origin" in resp.headers.getall("Vary")
        stream = {**COMPLETION, "stream": True}
        resp = await client.post("/v1/completions", json=stream, headers={**origin, **bearer()})
        assert resp.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")

        resp = await request(client, "GET", "/v1/models", {"Origin": "https://evil.example"})
        assert "Access-Control-Allow-Origin" not in resp.headers
        assert "Origin" in resp.headers.getall("Vary")  # caches must keep the answers apart


async def test_cors_any_origin_and_cors_off(tokenizer: Any) -> None:
    async with serve(tokenizer, allowed_origins=("*",)) as client:
        resp = await request(client, "GET", "/v1/models", {"Origin": "https://any.example"})
        assert resp.headers["Access-Control-Allow-Origin"] == "https://any.example"
    async with serve(tokenizer) as client:
        resp = await request(client, "GET", "/v1/models", {"Origin": ORIGIN})
        assert not any(h.startswith("Access-Control-") for h in resp.headers)
        headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
        resp = await client.options("/v1/completions", headers=headers)
        assert resp.status == 405


def test_allowed_origins_parsing() -> None:
    values = ["https://a.example, https://B.example/", "https://c.example,,", "https://a.example"]
    assert parse_origins(values) == ("https://a.example", "https://b.example", "https://c.example")
    assert parse_origins([]) == ()


# Request ids


async def test_request_id_is_echoed_on_every_kind_of_response(tokenizer: Any) -> None:
    with structlog.testing.capture_logs() as logs:
        async with serve(tokenizer, api_keys=KEYS) as client:
            cases = [
                ("GET", "/v1/models", {}, 401),
                ("GET", "/v1/no-such-route", bearer(), 404),
                ("GET", "/v1/models", bearer(), 200),
            ]
            for i, (method, path, headers, status) in enumerate(cases):
                given = {"X-Request-Id": f"trace-{i} A/b:c"}
                resp = await request(client, method, path, {**headers, **given})
                assert resp.status == status
                assert resp.headers["X-Request-Id"] == f"trace-{i} A/b:c"
            stream = {**COMPLETION, "stream": True}
            headers = {**bearer(), "X-Request-Id": "trace-sse"}
            resp = await client.post("/v1/completions", json=stream, headers=headers)
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            assert resp.headers["X-Request-Id"] == "trace-sse"
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    ids = [e["request_id"] for e in logs if e["event"] == "request"]
    assert ids == ["trace-0 A/b:c", "trace-1 A/b:c", "trace-2 A/b:c", "trace-sse"]


async def test_request_id_is_generated_when_absent_or_unsafe(tokenizer: Any) -> None:
    async with serve(tokenizer) as client:
        seen = set()
        for headers in ({}, {}, {"X-Request-Id": "x" * 129}, {"X-Request-Id": "a\tb"}):
            resp = await request(client, "GET", "/health", headers)
            request_id = resp.headers["X-Request-Id"]
            assert request_id.startswith("req_") and len(request_id) == 36
            seen.add(request_id)
        assert len(seen) == 4
        resp = await request(client, "GET", "/health", {"X-Request-Id": "y" * 128})
        assert resp.headers["X-Request-Id"] == "y" * 128


# TLS


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[trustme.CA, Path, Path]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    folder = tmp_path_factory.mktemp("tls")
    certfile, keyfile = folder / "cert.pem", folder / "key.pem"
    certfile.write_bytes(b"".join(pem.bytes() for pem in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(keyfile))
    return ca, certfile, keyfile


async def test_tls_with_the_openai_sdk_trusting_the_test_ca(
    tokenizer: Any, tls_files: tuple[trustme.CA, Path, Path]
) -> None:
    ca, certfile, keyfile = tls_files
    server_context = tls_context(str(certfile), str(keyfile))
    trust = ssl.create_default_context()
    ca.configure_trust(trust)
    async with serve(tokenizer, api_keys=KEYS, ssl_context=server_context) as client:
        for host in ("127.0.0.1", "localhost"):
            async with openai.AsyncOpenAI(
                base_url=f"https://{host}:{client.port}/v1",
                api_key=KEY,
                http_client=openai.DefaultAsyncHttpxClient(verify=trust),
                max_retries=0,
            ) as sdk:
                out = await sdk.completions.create(model=MODEL, prompt="Sing", max_tokens=3)
                assert out.choices[0].text == " la la la"
                stream = await sdk.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "Sing"}],
                    max_tokens=2,
                    stream=True,
                )
                assert [c async for c in stream]
        base = f"https://127.0.0.1:{client.port}/v1"
        async with openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as untrusting:
            with pytest.raises(openai.APIConnectionError):
                await untrusting.models.list()
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientError):  # plain HTTP to the TLS port
                url = f"http://127.0.0.1:{client.port}/health"
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    await resp.read()


def test_tls_context_errors(tls_files: tuple[trustme.CA, Path, Path], tmp_path: Path) -> None:
    _, certfile, keyfile = tls_files
    assert tls_context(None, None) is None
    with pytest.raises(ConfigError, match="given together"):
        tls_context(str(certfile), None)
    with pytest.raises(ConfigError, match="no such file"):
        tls_context(str(tmp_path / "nope.pem"), str(keyfile))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    for cert, key in [(garbage, keyfile), (certfile, garbage), (keyfile, certfile)]:
        with pytest.raises(ConfigError, match="cannot load TLS certificate"):
            tls_context(str(cert), str(key))
    encrypted = tmp_path / "encrypted-key.pem"
    key = serialization.load_pem_private_key(keyfile.read_bytes(), password=None)
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(ConfigError, match="is encrypted"):  # and no terminal prompt
        tls_context(str(certfile), str(encrypted))
    other_key = tmp_path / "other-key.pem"
    trustme.CA().issue_cert("127.0.0.1").private_key_pem.write_to_path(str(other_key))
    with pytest.raises(ConfigError, match="cannot load TLS certificate"):
        tls_context(str(certfile), str(other_key))


# Start-up errors: the security flags are checked before the model loads.


def sluice(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-m", "sluice", "--model-path", "/no/such/model.gguf", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ssl-certfile", "/nope", "--ssl-keyfile", "/nope"], "--ssl-certfile /nope: no such"),
        (["--ssl-certfile", "/nope"], "must be given together"),
        (["--api-key-file", "/nope"], "cannot read --api-key-file /nope"),
    ],
)
def test_bad_security_flags_are_one_line_start_up_errors(args: list[str], message: str) -> None:
    out = sluice(*args)
    assert out.returncode == 2
    # One line, naming the flag, before the (missing) model is even looked at.
    assert out.stderr.count("\n") == 1 and message in out.stderr
    assert "Traceback" not in out.stderr and "model" not in out.stderr

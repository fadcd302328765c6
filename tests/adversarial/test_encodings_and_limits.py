"""Request bodies, model-free: content codings, per-route size limits and the body's
deadline over the real app, routes and tokenizer with the fake engine. Every refusal is in
OpenAI's envelope with its own status and code, logs no traceback, and leaves the server
serving the next request."""

from __future__ import annotations

import asyncio
import gzip
import logging
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest
import structlog
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sluice.http import body as body_module
from sluice.http.app import MAX_BODY_BYTES, create_app
from sluice.http.routes.native import ID_JSON_BYTES, OTHER_FIELDS_BYTES
from sluice.http.state import ServerState
from sluice.pipeline.prompt_bounds import TokenReach, token_reach
from tests.support.fake_engine import MODEL, FakeEngine, fake_state
from tests.support.openapi import validate

pytestmark = pytest.mark.anyio

COMPLETIONS = "/v1/completions"
COMPLETION = {"model": MODEL, "prompt": "Sing", "max_tokens": 2}
CONTEXT = FakeEngine([0]).max_context


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # aiohttp runs on asyncio only


@pytest.fixture
def quiet_logs(caplog: pytest.LogCaptureFixture) -> Iterator[list[dict[str, Any]]]:
    """Whatever a test sends, nothing it causes is logged with a traceback."""
    caplog.set_level(logging.DEBUG)
    with structlog.testing.capture_logs() as logs:
        yield logs
    assert not [e for e in logs if "exc_info" in e or e.get("event") == "unhandled error"]
    assert not [r for r in caplog.records if r.exc_info], caplog.text
    assert "Traceback" not in caplog.text


@pytest.fixture
def state(tokenizer: Any) -> ServerState:
    return fake_state(tokenizer, FakeEngine(tokens=tokenizer.encode(" la")))


@pytest.fixture
async def client(
    state: ServerState, quiet_logs: list[dict[str, Any]]
) -> AsyncIterator[TestClient[Any, Any]]:
    client = TestClient(TestServer(create_app(state)))
    await client.start_server()
    try:
        yield client
    finally:
        resp = await client.post(COMPLETIONS, json=COMPLETION)
        assert resp.status == 200, await resp.text()
        await client.close()


@pytest.fixture
def reach(tokenizer: Any) -> TokenReach:
    found = token_reach(tokenizer)
    assert found is not None
    return found


async def post(
    client: TestClient[Any, Any], path: str, data: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    resp = await client.post(
        path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    return resp.status, orjson.loads(await resp.read()), dict(resp.headers)


def error_of(
    status: int, body: dict[str, Any], expected: int, code: str | None, param: str | None = None
) -> dict[str, Any]:
    """The error object, once the status, OpenAI's envelope, ``code`` and ``param`` match."""
    assert status == expected, body
    validate("ErrorResponse", body)
    error: dict[str, Any] = body["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        code,
        param,
    ), error
    return error


def raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


# --------------------------------------------------------------------- content codings

BODY = orjson.dumps(COMPLETION)


@pytest.mark.parametrize(
    ("coding", "data"),
    [
        ("gzip", gzip.compress(BODY)),
        ("GZip", gzip.compress(BODY)),
        ("x-gzip", gzip.compress(BODY)),
        ("gzip", gzip.compress(BODY[:10]) + gzip.compress(BODY[10:])),  # two members
        ("deflate", zlib.compress(BODY)),
        ("deflate", raw_deflate(BODY)),  # as some clients send it
        ("identity", BODY),
        ("identity, gzip", gzip.compress(BODY)),
        ("", BODY),
    ],
)
async def test_accepted_codings(client: TestClient[Any, Any], coding: str, data: bytes) -> None:
    status, body, _ = await post(client, COMPLETIONS, data, {"Content-Encoding": coding})
    assert status == 200, body
    assert body["choices"][0]["text"] == " la la"


@pytest.mark.parametrize(
    ("coding", "data", "detail"),
    [
        ("gzip", b"not gzip at all", "incorrect header check"),
        ("gzip", gzip.compress(BODY)[:-12], "ends early"),
        ("gzip", gzip.compress(BODY) + b"junk", "incorrect header check"),
        ("deflate", b"\x78\x9cgarbage", "invalid"),
        ("deflate", zlib.compress(BODY)[:-6], "ends early"),
        ("deflate", zlib.compress(BODY) + b"junk", "after the end"),
    ],
)
async def test_a_body_that_does_not_decode_is_a_400_naming_the_coding(
    client: TestClient[Any, Any], coding: str, data: bytes, detail: str
) -> None:
    status, body, _ = await post(client, COMPLETIONS, data, {"Content-Encoding": coding})
    error = error_of(status, body, 400, "invalid_content_encoding")
    assert f"not valid {coding} data" in error["message"]
    assert detail in error["message"]


@pytest.mark.parametrize("coding", ["br", "zstd", "compress", "x-foo", "gzip, gzip", "gzip, br"])
async def test_an_unsupported_coding_is_a_415_saying_what_is_accepted(
    client: TestClient[Any, Any], coding: str
) -> None:
    """br and zstd included: aiohttp decodes them only with optional libraries, which the
    server does not depend on."""
    status, body, headers = await post(client, COMPLETIONS, BODY, {"Content-Encoding": coding})
    error = error_of(status, body, 415, "unsupported_content_encoding")
    assert repr(coding) in error["message"] and "gzip, deflate" in error["message"]
    assert headers["Accept-Encoding"] == "gzip, deflate"  # RFC 9110 §12.5.3


async def test_the_coding_is_checked_on_every_route_that_reads_a_body(
    client: TestClient[Any, Any],
) -> None:
    for path, data in [
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
        ("/tokenize", {"prompt": "x"}),
        ("/detokenize", {"tokens": [1]}),
        ("/generate", {"text": "x"}),
        ("/v1/responses", {"model": MODEL, "input": "x"}),
    ]:
        raw = orjson.dumps(data)
        status, body, _ = await post(client, path, raw, {"Content-Encoding": "br"})
        error_of(status, body, 415, "unsupported_content_encoding")
        status, body, _ = await post(client, path, b"\x1f\x8bxx", {"Content-Encoding": "gzip"})
        error_of(status, body, 400, "invalid_content_encoding")
        status, body, _ = await post(client, path, gzip.compress(raw), {"Content-Encoding": "gzip"})
        assert status == 200, (path, body)


# ------------------------------------------------------------------------ size limits


def tokenize_limit(reach: TokenReach) -> int:
    return reach.max_json_bytes(CONTEXT) + OTHER_FIELDS_BYTES


def test_the_bound_of_the_test_tokenizer(reach: TokenReach, tokenizer: Any) -> None:
    """SmolLM2's longest entry is a newline and 80 spaces; its worst escaping is a
    newline and 18 tabs, all as \\u00XX. A text of that entry over and over reaches it."""
    assert reach == TokenReach(text_bytes=81, json_bytes=114)
    entry = "\n" + " " * 80
    assert len(tokenizer.encode(entry * 100)) == 100


VOCAB = {"a": 0, "b": 1, "ab": 2, "<unk>": 3, "▁▁▁": 4}


def toy(model: Any = None, normalizer: Any = None, pre_tokenizer: Any = None, **bpe: Any) -> Any:
    """A tokenizer over ``VOCAB`` (BPE unless ``model``), with the given stages."""
    backend = Tokenizer(model or models.BPE(vocab=VOCAB, merges=[("a", "b")], **bpe))
    if normalizer is not None:
        backend.normalizer = normalizer
    if pre_tokenizer is not None:
        backend.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_the_bound_is_given_only_where_tokenizing_keeps_every_byte() -> None:
    """Entries count at their UTF-8 length ("▁▁▁": 9 bytes, 18 as three \\u2581);
    normal forms multiply by how much they can shrink a text; a stage that can drop
    input leaves no bound at all."""
    base = TokenReach(text_bytes=9, json_bytes=18)
    assert token_reach(toy()) == base
    assert token_reach(toy(unk_token="<unk>")) == base  # one unknown character: 4 bytes
    assert token_reach(toy(normalizer=normalizers.NFC())) == TokenReach(27, 108)
    nfkc_lower = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    assert token_reach(toy(normalizer=nfkc_lower)) == TokenReach(108, 1296)
    sentencepiece = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    assert token_reach(toy(normalizer=sentencepiece)) == base
    kept = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "isolated"), pre_tokenizers.Digits()])
    assert token_reach(toy(pre_tokenizer=kept)) == base
    special = toy()
    special.add_special_tokens({"additional_special_tokens": ["<|a long special token|>"]})
    assert token_reach(special) == TokenReach(24, 34)  # "<" and ">" as \\u003c, \\u003e
    for dropping in [
        toy(unk_token="<unk>", fuse_unk=True),  # a run of unknowns is one token
        toy(normalizer=normalizers.BertNormalizer()),  # drops control characters
        toy(normalizer=normalizers.Replace(" ", "")),
        toy(pre_tokenizer=pre_tokenizers.WhitespaceSplit()),
        toy(pre_tokenizer=pre_tokenizers.Split(" ", "removed")),
        toy(models.WordPiece(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]")),  # a word as one
    ]:
        assert token_reach(dropping) is None


async def test_tokenize_takes_a_prompt_that_fills_the_context(
    client: TestClient[Any, Any], reach: TokenReach
) -> None:
    """The bound refuses nothing that fits: a text of exactly the most bytes that can fit
    tokenizes into exactly the context."""
    text = ("\n" + " " * 80) * CONTEXT
    assert len(text.encode()) == reach.max_text_bytes(CONTEXT)
    status, body, _ = await post(client, "/tokenize", orjson.dumps({"prompt": text}))
    assert status == 200, body
    assert body["count"] == CONTEXT == body["max_model_len"]


@pytest.mark.parametrize("path", ["/tokenize", "/v1/tokenize"])
async def test_tokenize_body_over_its_limit_is_a_413_naming_it(
    client: TestClient[Any, Any], reach: TokenReach, path: str
) -> None:
    limit = tokenize_limit(reach)
    assert limit < MAX_BODY_BYTES // 30
    raw = b'{"prompt": "' + b"x" * limit + b'"}'
    error = error_of(*(await post(client, path, raw))[:2], 413, "request_too_large")
    assert str(limit) in error["message"] and f"for {path}" in error["message"]
    assert f"({CONTEXT} tokens)" in error["message"]


async def test_tokenize_limit_holds_without_a_content_length(
    client: TestClient[Any, Any], reach: TokenReach
) -> None:
    """A chunked body is counted as it arrives."""

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(tokenize_limit(reach) // 65536 + 1):
            yield b"x" * 65536
        yield b'"}'

    error_of(*(await post(client, "/tokenize", chunks()))[:2], 413, "request_too_large")


async def test_tokenize_limit_holds_for_a_compressed_body(
    client: TestClient[Any, Any], reach: TokenReach
) -> None:
    raw = b'{"prompt": "' + b"x" * tokenize_limit(reach) + b'"}'
    bomb = gzip.compress(raw)
    assert len(bomb) < 10_000
    headers = {"Content-Encoding": "gzip"}
    error_of(*(await post(client, "/tokenize", bomb, headers))[:2], 413, "request_too_large")


class NoEncoding:
    """The tokenizer, but tokenizing fails the test: refusals must come first."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise AssertionError("tokenized a text that cannot fit")


@pytest.mark.parametrize(
    ("prompt", "param"),
    [
        ("x" * (81 * CONTEXT + 1), "prompt"),
        (["fine", "é" * (81 * CONTEXT // 2 + 1)], "prompt[1]"),
    ],
)
async def test_tokenize_refuses_a_text_that_cannot_fit_before_tokenizing(
    client: TestClient[Any, Any], state: ServerState, prompt: Any, param: str
) -> None:
    real = state.pipeline.tokenizer
    state.pipeline.tokenizer = NoEncoding(real)
    try:
        raw = orjson.dumps({"prompt": prompt})
        error = error_of(*(await post(client, "/tokenize", raw))[:2], 400,
                         "context_length_exceeded", param)  # fmt: skip
    finally:
        state.pipeline.tokenizer = real
    assert f"at most {81 * CONTEXT} bytes fit" in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "x" * (81 * CONTEXT + 1)}, "prompt"),
        ("/generate", {"text": "é" * (81 * CONTEXT // 2 + 1)}, "text"),
    ],
)
async def test_a_generation_prompt_that_cannot_fit_is_refused_before_tokenizing(
    client: TestClient[Any, Any], state: ServerState, path: str, body: Any, param: str
) -> None:
    real = state.pipeline.tokenizer
    state.pipeline.tokenizer = NoEncoding(real)
    try:
        raw = orjson.dumps(body)
        error = error_of(*(await post(client, path, raw))[:2], 400,
                         "context_length_exceeded", param)  # fmt: skip
    finally:
        state.pipeline.tokenizer = real
    assert f"at most {81 * CONTEXT} bytes fit" in error["message"]


async def test_detokenize_body_over_its_limit_is_a_413(client: TestClient[Any, Any]) -> None:
    limit = CONTEXT * ID_JSON_BYTES + OTHER_FIELDS_BYTES
    fits = orjson.dumps({"tokens": [1] * CONTEXT}, option=orjson.OPT_INDENT_2)
    assert len(fits) < limit
    status, body, _ = await post(client, "/detokenize", fits)
    assert status == 200, body
    raw = b'{"tokens": [' + b"1," * (limit // 2) + b"1]}"
    error = error_of(*(await post(client, "/detokenize", raw))[:2], 413, "request_too_large")
    assert str(limit) in error["message"]


async def test_generation_routes_keep_the_general_limit(client: TestClient[Any, Any]) -> None:
    """Their bodies carry tools, histories and conversations besides the prompt: no bound
    from the model applies, so the server's limit does."""
    raw = b'{"model": "m", "prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'
    error = error_of(*(await post(client, COMPLETIONS, raw))[:2], 413, "request_too_large")
    assert str(MAX_BODY_BYTES) in error["message"]


# ---------------------------------------------------------------------- the deadline


Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@pytest.fixture
async def raw_connections() -> AsyncIterator[list[Stream]]:
    """Sockets a test writes by hand, closed after it."""
    streams: list[Stream] = []
    yield streams
    for _, writer in streams:
        writer.close()


async def send_head(
    client: TestClient[Any, Any], streams: list[Stream], length: int, first: bytes
) -> Stream:
    """A request's head announcing ``length`` bytes of body, and the ``first`` of them."""
    stream = await asyncio.open_connection(client.host, client.port)
    streams.append(stream)
    stream[1].write(
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n".encode()
        + first
    )
    await stream[1].drain()
    return stream


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status_line, *lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines if line)
    body = await asyncio.wait_for(reader.readexactly(int(headers["Content-Length"])), 10)
    return int(status_line.split()[1]), headers, body


async def test_a_body_that_stops_arriving_is_a_408_that_closes_the_connection(
    client: TestClient[Any, Any], raw_connections: list[Stream], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(body_module, "BODY_GRACE_S", 0.3)
    reader, _ = await send_head(client, raw_connections, 1000, b'{"model": ')
    status, headers, raw = await read_response(reader)
    error = error_of(status, orjson.loads(raw), 408, "request_timeout")
    assert "10 bytes" in error["message"]
    # Closed once aiohttp's lingering read (up to 10 s) has given the client time to
    # read this answer.
    assert headers["Connection"] == "close"


async def test_a_trickled_body_is_cut_off(
    client: TestClient[Any, Any], raw_connections: list[Stream], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A byte at a time keeps arriving, but slower than the minimum rate."""
    monkeypatch.setattr(body_module, "BODY_GRACE_S", 0.3)
    monkeypatch.setattr(body_module, "BODY_MIN_RATE", 100)
    reader, writer = await send_head(client, raw_connections, 10_000, b"{")

    async def trickle() -> None:
        for _ in range(200):
            writer.write(b" ")
            await asyncio.sleep(0.05)  # 20 bytes a second

    trickling = asyncio.create_task(trickle())
    try:
        status, _, raw = await read_response(reader)
    finally:
        trickling.cancel()
    error_of(status, orjson.loads(raw), 408, "request_timeout")


async def test_a_body_arriving_fast_enough_is_read_however_long_it_takes(
    client: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(body_module, "BODY_GRACE_S", 0.3)
    monkeypatch.setattr(body_module, "BODY_MIN_RATE", 100)
    raw = orjson.dumps(COMPLETION)

    async def paced() -> AsyncIterator[bytes]:
        for i in range(0, len(raw), 10):  # 10 bytes every 50 ms: twice the minimum rate
            yield raw[i : i + 10]
            await asyncio.sleep(0.05)

    status, body, _ = await post(client, COMPLETIONS, paced())
    assert status == 200, body


@pytest.mark.parametrize("cancellation", [True, False])
async def test_a_client_that_leaves_mid_body_logs_no_traceback(
    state: ServerState, quiet_logs: list[dict[str, Any]], cancellation: bool
) -> None:
    """With aiohttp's ``handler_cancellation`` (as ``sluice`` runs) the handler is
    cancelled; without it (aiohttp's default) the read fails with a ConnectionError."""
    runner = web.AppRunner(create_app(state), handler_cancellation=cancellation)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
        writer.write(head.encode() + b'{"model": ')
        await writer.drain()
        await asyncio.sleep(0.1)  # the handler is reading the body
        writer.close()
        await writer.wait_closed()
        await asyncio.sleep(0.2)  # the server notices and ends the handler
    finally:
        await runner.cleanup()
    statuses = [e["status"] for e in quiet_logs if e.get("event") == "request"]
    assert statuses == [499 if cancellation else 400]

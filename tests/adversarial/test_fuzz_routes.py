"""Hostile values in every field of every generation route, sent to the shared server
while healthy streams run beside them.

Each field of each route (the official spec's request schemas plus SGLang's extension
fields) gets each value of ``HOSTILE``: integers past 32 and 64 bits, whole-number
floats past them (``1e19``, which a lax validator turns into an integer), negatives,
wrong types, nested junk and a regex whose lexer cannot run. Then bodies and
encodings the edge must refuse. Meanwhile greedy streams are restarted in a loop, and
each must reproduce, token for token, what it gave alone before the fuzzing.

It asserts: no 5xx and no error frame of the server's own inside a 200 stream, every
request answered in bounded time, every refusal in OpenAI's envelope and every 400
naming the field that was given the value, the healthy streams untouched, and no
traceback in the server's log for any of it.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import time
import zlib
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from tests.support.openapi import load_spec
from tests.support.openapi import validate as validate_spec

if TYPE_CHECKING:
    from tests.conftest import Server

pytestmark = pytest.mark.model

HOSTILE: tuple[object, ...] = (
    10**19,
    1e19,
    -(10**19),
    2**31,
    2**63,
    -1,
    0,
    0.5,
    True,
    "x",
    [10**19],
    {"a": [1e19]},
    "(a{1000}){1000}",
)
SAMPLING_EXTENSIONS = (
    "top_k", "min_p", "min_tokens", "repetition_penalty", "stop_token_ids", "ignore_eos",
    "regex", "ebnf", "json_schema", "no_stop_trim", "skip_special_tokens", "priority",
    "spaces_between_special_tokens", "continuous_usage_stats", "rid",
)  # fmt: skip
CHAT_EXTENSIONS = (
    "separate_reasoning", "stream_reasoning", "chat_template_kwargs",
    "continue_final_message",
)  # fmt: skip
GENERATE_TOP = (
    "text", "input_ids", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_text_in_logprobs", "rid", "stream", "model", "token_ids_logprob", "priority",
)  # fmt: skip
GENERATE_SAMPLING = (
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "n",
    "stop", "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "sampling_seed", "ignore_eos", "logit_bias", "regex", "json_schema", "ebnf",
    "skip_special_tokens", "no_stop_trim",
)  # fmt: skip
STREAM_PROMPTS = ("The capital of France is", "Once upon a time", "def fibonacci(n):")
STREAM_TOKENS = 40
CONCURRENCY = 4
REQUEST_TIMEOUT_S = 120


def spec_fields(schema_name: str) -> list[str]:
    """The request fields a spec schema declares, through ``allOf`` and ``$ref``."""
    schemas = load_spec()["components"]["schemas"]
    names: set[str] = set()

    def walk(node: dict[str, Any]) -> None:
        if "$ref" in node:
            walk(schemas[node["$ref"].rsplit("/", 1)[1]])
        names.update(node.get("properties", {}))
        for part in node.get("allOf", []):
            walk(part)

    walk(schemas[schema_name])
    return sorted(names)


def cases(model: str) -> list[tuple[str, dict[str, Any], str]]:
    """(path, body, field): each field of each route given each hostile value."""
    routes: list[tuple[str, dict[str, Any], list[str]]] = [
        (
            "/v1/completions",
            {"model": model, "prompt": "Hi", "max_tokens": 2},
            spec_fields("CreateCompletionRequest") + list(SAMPLING_EXTENSIONS),
        ),
        (
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            spec_fields("CreateChatCompletionRequest")
            + list(SAMPLING_EXTENSIONS + CHAT_EXTENSIONS),
        ),
        (
            "/v1/responses",
            {"model": model, "input": "Hi", "max_output_tokens": 16, "store": False},
            [*spec_fields("CreateResponse"), "top_k", "min_p", "repetition_penalty"],
        ),
        ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}, list(GENERATE_TOP)),
        ("/tokenize", {"model": model, "prompt": "Hi"}, ["prompt", "add_special_tokens"]),
        ("/detokenize", {"model": model, "tokens": [1, 2]}, ["tokens"]),
    ]
    out: list[tuple[str, dict[str, Any], str]] = []
    for path, base, fields in routes:
        for field in dict.fromkeys(fields):
            for value in HOSTILE:
                out.append((path, {**base, field: value}, field))
    base = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
    for field in GENERATE_SAMPLING:
        for value in HOSTILE:
            sampling = {"max_new_tokens": 2, field: value}
            out.append(
                ("/generate", {**base, "sampling_params": sampling}, f"sampling_params.{field}")
            )
    return out


def raw_cases(model: str) -> list[tuple[str, bytes, dict[str, str]]]:
    """(path, body, headers): bodies and encodings the edge must refuse."""
    good = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 2}).encode()
    json_type = {"Content-Type": "application/json"}
    out: list[tuple[str, bytes, dict[str, str]]] = [
        ("/v1/completions", b"", json_type),
        ("/v1/completions", b"{", json_type),
        ("/v1/completions", b"[]", json_type),
        ("/v1/completions", b'{"model": NaN}', json_type),
        ("/v1/completions", b"\xff\xfe", json_type),
        ("/v1/completions", good, {"Content-Type": "text/plain"}),
    ]
    for encoding, body in [
        ("gzip", b"not gzip at all"),
        ("gzip", gzip.compress(good)[:-9]),
        ("deflate", b"\x00garbage"),
        ("deflate", zlib.compress(good)[:-5]),
        ("br", good),
        ("zstd", good),
        ("x-foo", good),
    ]:
        for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/tokenize"):
            out.append((path, body, {**json_type, "Content-Encoding": encoding}))
    return out


async def healthy_stream(http: aiohttp.ClientSession, server: Server, prompt: str) -> str:
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": STREAM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text = ""
    async with http.post(f"{server.v1}/completions", json=body) as response:
        assert response.status == 200
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += "".join(choice["text"] for choice in chunk["choices"])
    return text


async def send(
    http: aiohttp.ClientSession, url: str, *, body: bytes, headers: dict[str, str]
) -> tuple[int, bytes]:
    async with http.post(url, data=body, headers=headers) as response:
        return response.status, await response.read()


def check_answer(
    what: str, status: int, payload: bytes, problems: list[str], field: str | None = None
) -> None:
    """A 5xx, a refusal outside the envelope or blaming another field than the one
    given the hostile value, or a 200 that carries a server error, is a problem."""
    if status >= 500:
        problems.append(f"{what}: {status} {payload[:300]!r}")
    elif status >= 400:
        try:
            body = json.loads(payload)
            validate_spec("ErrorResponse", body)
        except (ValueError, AssertionError) as exc:
            problems.append(f"{what}: {status} outside the envelope: {exc}")
            return
        param = body["error"]["param"] or ""
        if (
            status == 400
            and field is not None
            and not (param == field or param.startswith((f"{field}.", f"{field}[")))
        ):
            problems.append(f"{what}: the 400 names {param!r}: {body['error']['message']}")
    elif b"server_error" in payload or b"engine error" in payload:
        problems.append(f"{what}: {status} carried a server error: {payload[-300:]!r}")


def test_hostile_fields_never_touch_healthy_streams(server: Server) -> None:
    log = server.log
    assert log is not None
    log_start = log.stat().st_size

    async def run() -> tuple[list[str], int, int]:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            references = [await healthy_stream(http, server, p) for p in STREAM_PROMPTS]
            problems: list[str] = []
            # (url, body, headers, what to call it, the field given the hostile value)
            requests: list[tuple[str, bytes, dict[str, str], str, str | None]] = [
                (f"{server.base_url}{path}", json.dumps(body).encode(), {}, f"{path} {body}", field)
                for path, body, field in cases(server.model)
            ] + [
                (
                    f"{server.base_url}{path}",
                    body,
                    headers,
                    f"{path} {headers} {body[:40]!r}",
                    None,
                )
                for path, body, headers in raw_cases(server.model)
            ]
            queue = list(reversed(requests))
            fuzzing = True

            async def fuzz_worker() -> None:
                while queue:
                    url, body, headers, what, field = queue.pop()
                    try:
                        status, payload = await send(
                            http,
                            url,
                            body=body,
                            headers=headers or {"Content-Type": "application/json"},
                        )
                    except TimeoutError:
                        problems.append(f"{what}: no answer in {REQUEST_TIMEOUT_S} s")
                        continue
                    check_answer(what, status, payload, problems, field)

            async def streams_worker() -> int:
                """Rounds of the healthy streams until the fuzzing ends; how many ran."""
                rounds = 0
                while fuzzing:
                    texts = await asyncio.gather(
                        *(healthy_stream(http, server, p) for p in STREAM_PROMPTS)
                    )
                    outcomes = zip(STREAM_PROMPTS, texts, references, strict=True)
                    for prompt, text, expected in outcomes:
                        if text != expected:
                            problems.append(f"healthy stream {prompt!r}: {text!r} != {expected!r}")
                    rounds += 1
                return rounds

            streams = asyncio.create_task(streams_worker())
            await asyncio.gather(*(fuzz_worker() for _ in range(CONCURRENCY)))
            fuzzing = False
            return problems, len(requests), await streams

    started = time.monotonic()
    problems, sent, rounds = asyncio.run(run())
    assert not problems, f"{len(problems)} of {sent} requests:\n" + "\n".join(problems[:20])
    assert rounds >= 1, "no healthy stream ran beside the fuzzing"
    with log.open("rb") as out:
        out.seek(log_start)
        written = out.read()
    assert b"Traceback" not in written, written[written.find(b"Traceback") - 500 :][:3000]
    print(f"{sent} hostile requests and {rounds} rounds of healthy streams in "
          f"{time.monotonic() - started:.0f} s")  # fmt: skip

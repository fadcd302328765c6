"""SGLang's native worker API through the real app over the fake engine (no model):
what ``/generate`` accepts and refuses (including the fields SMG adds when it forwards
a request), its SGLang shapes, ``/abort_request`` (one rid or all), ``/flush_cache``
refused while busy, and a recorded ``/generate`` replaying byte for byte."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from sluice.http.app import create_app
from sluice.http.protocol.generate import parse_generate_request
from sluice.http.state import ServerState
from tests.support.fake_engine import MODEL, FakeEngine, fake_state
from tests.support.openapi import validate

Client = TestClient[Any, Any]


def run(
    tokenizer: Any,
    step: Callable[[Client, FakeEngine], Awaitable[Any]],
    *,
    step_s: float = 0.001,
    state: Callable[[FakeEngine], ServerState] | None = None,
) -> Any:
    async def go() -> Any:
        engine = FakeEngine(tokens=tokenizer.encode(" la"), step_s=step_s)
        app = create_app(state(engine) if state else fake_state(tokenizer, engine))
        client = TestClient(TestServer(app))
        await client.start_server()
        try:
            return await step(client, engine)
        finally:
            await client.close()

    return anyio.run(go)


async def until(condition: Callable[[], bool]) -> None:
    """Poll state the fake engine changes from its timers (no event to wait on)."""
    with anyio.fail_after(30):
        while True:
            if condition():
                return
            await anyio.sleep(0.01)


async def post(client: Client, path: str, body: Any, status: int = 200) -> Any:
    resp = await client.post(path, json=body)
    raw = await resp.read()
    assert resp.status == status, raw[:2000]
    return raw


def test_what_smg_adds_when_it_forwards_is_accepted(tokenizer: Any) -> None:
    """SMG re-serialises bodies: /generate gains model "unknown" and its switches at
    their defaults; chat, completions and Responses gain SGLang's ``priority: 0``."""
    smg_generate = {"text": "Sing", "sampling_params": {"max_new_tokens": 2}, "model": "unknown",
                    "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
                    "background": False, "no_logs": False, "return_bytes": False,
                    "return_entropy": False}  # fmt: skip
    smg_responses = {"model": MODEL, "input": "Sing", "max_output_tokens": 16, "store": True,
                     "temperature": 1.0, "priority": 0, "top_k": -1, "min_p": 0.0,
                     "repetition_penalty": 1.0}  # fmt: skip

    async def step(client: Client, engine: FakeEngine) -> Any:
        generated = orjson.loads(await post(client, "/generate", smg_generate))
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2, "logprobs": False, "stream": False, "priority": 0}  # fmt: skip
        await post(client, "/v1/chat/completions", chat)
        await post(client, "/v1/completions", {"model": MODEL, "prompt": "x", "echo": False,
                                               "max_tokens": 2, "priority": 0})  # fmt: skip
        await post(client, "/v1/responses", smg_responses)
        refused = orjson.loads(await post(client, "/v1/completions", {"model": MODEL,
                               "prompt": "x", "priority": 2}, status=400))  # fmt: skip
        return generated, refused

    generated, refused = run(tokenizer, step)
    assert generated["text"] == " la la" and generated["output_ids"] == tokenizer.encode(" la") * 2
    assert generated["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    validate("ErrorResponse", refused)
    assert refused["error"]["param"] == "priority"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "text"),
        ({"text": "x", "input_ids": [1]}, "input_ids"),
        ({"text": []}, "text"),
        ({"text": ""}, "text"),
        ({"input_ids": [[1], []]}, "input_ids"),
        ({"input_ids": [1, "2"]}, "input_ids"),
        ({"text": "x", "sampling_params": {"max_tokens": 3}}, "sampling_params.max_tokens"),
        ({"text": "x", "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"text": "x", "sampling_params": {"temperature": 3}}, "sampling_params.temperature"),
        ({"text": "x", "sampling_params": {"stream_interval": 2}},
         "sampling_params.stream_interval"),
        ({"text": "x", "sampling_params": {"stop_regex": "a"}}, "sampling_params.stop_regex"),
        ({"text": "x", "sampling_params": {"regex": "a", "ebnf": "b"}}, "sampling_params.ebnf"),
        ({"text": "x", "sampling_params": [{}]}, "sampling_params"),
        ({"text": "x", "top_logprobs_num": 9}, "top_logprobs_num"),
        ({"text": "x", "top_logprobs_num": 2}, "top_logprobs_num"),
        ({"text": "x", "logprob_start_len": 0}, "logprob_start_len"),
        ({"text": "x", "return_text_in_logprobs": True}, "return_text_in_logprobs"),
        ({"text": "x", "token_ids_logprob": [1]}, "token_ids_logprob"),
        ({"text": "x", "return_entropy": True}, "return_entropy"),
        ({"text": "x", "log_metrics": False}, "log_metrics"),
        ({"text": "x", "rid": ["a"]}, "rid"),
        ({"text": "x", "lora_path": "a"}, "lora_path"),
    ],
)  # fmt: skip
def test_bad_bodies_name_their_field(body: dict[str, Any], param: str) -> None:
    from sluice.http.errors import ApiError

    with pytest.raises(ApiError) as raised:
        parse_generate_request(body)
    assert raised.value.status == 400 and raised.value.param == param, raised.value.message


def test_sampling_params_take_sglangs_names() -> None:
    req = parse_generate_request({"input_ids": [[5, 6], [7]], "sampling_params": {
        "max_new_tokens": 9, "min_new_tokens": 2, "sampling_seed": 7, "temperature": 0,
        "top_k": 5, "stop": ["x"], "stop_token_ids": [3], "ignore_eos": True,
        "no_stop_trim": True, "skip_special_tokens": False, "json_schema": '{"type":"object"}',
    }, "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 2})  # fmt: skip
    s = req.sampling
    assert (s.max_tokens, s.min_tokens, s.seed, s.greedy, s.top_k) == (9, 2, 7, True, 5)
    assert s.stop_token_ids == {3} and s.ignore_eos and s.logprobs == 2 and s.prompt_logprobs == 2
    assert s.constraint is not None and s.constraint.kind == "json_schema"
    assert req.prompts == ((5, 6), (7,)) and req.batch and req.stop == ("x",)
    assert (req.no_stop_trim, req.skip_special_tokens, req.logprob_start_len) == (True, False, 1)
    one = parse_generate_request({"text": "x"})
    assert one.sampling.max_tokens == 128 and not one.batch  # SGLang's default
    assert one.logprob_start_len is None and one.sampling.prompt_logprobs is None
    assert parse_generate_request({"text": "x", "sampling_params": {"n": 2}}).batch


def test_abort_request_ends_one_rid_or_all(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        results: dict[str, Any] = {}

        async def one(rid: str) -> None:
            body = {"text": "Sing", "rid": rid, "sampling_params": {"max_new_tokens": 5000}}
            results[rid] = orjson.loads(await post(client, "/generate", body))

        async with anyio.create_task_group() as tg:
            for rid in ("a", "b", "c"):
                tg.start_soon(one, rid)
            await until(lambda: len(engine.running) == 3 and engine.generated_tokens >= 6)
            await post(client, "/abort_request", {"rid": "a"})
            await post(client, "/abort_request", {"rid": "not-running"})
            await until(lambda: "a" in results)
            assert not {"b", "c"} & results.keys()
            await post(client, "/abort_request", {"abort_all": True})
        return results

    results = run(tokenizer, step, step_s=0.01)
    for rid in ("a", "b", "c"):
        meta = results[rid]["meta_info"]
        assert meta["id"] == rid and meta["finish_reason"]["type"] == "abort"
        assert 0 < meta["completion_tokens"] < 5000


def test_flush_cache_is_refused_while_requests_run(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        async with anyio.create_task_group() as tg:
            body = {"text": "Sing", "sampling_params": {"max_new_tokens": 50}}
            tg.start_soon(post, client, "/generate", body)
            await until(lambda: bool(engine.running))
            busy = await client.post("/flush_cache")
            busy_text = await busy.text()
        idle = await client.post("/flush_cache")
        return busy.status, busy_text, idle.status

    status, text, idle = run(tokenizer, step, step_s=0.01)
    assert status == 400 and "not flushed" in text and idle == 200


def test_tokenize_and_detokenize_shapes_and_errors(tokenizer: Any) -> None:
    async def step(client: Client, engine: FakeEngine) -> Any:
        many = orjson.loads(await post(client, "/tokenize", {"prompt": ["a b", "c"]}))
        body = {"prompt": "a b", "model": MODEL, "add_special_tokens": False}
        plain = orjson.loads(await post(client, "/v1/tokenize", body))
        text = orjson.loads(await post(client, "/detokenize", {"tokens": many["tokens"][0]}))
        errors = [
            orjson.loads(await post(client, path, body, status=400))
            for path, body in [
                ("/tokenize", {"prompt": 3}),
                ("/tokenize", {"prompt": "a", "model": "other"}),
                ("/detokenize", {"tokens": [10**9]}),
                ("/detokenize", {"tokens": ["a"]}),
                ("/tokenize", {"prompt": "a", "extra": 1}),
            ]
        ]
        return many, plain, text, errors

    many, plain, text, errors = run(tokenizer, step)
    assert many["tokens"] == [tokenizer.encode("a b"), tokenizer.encode("c")]
    assert many["count"] == [len(t) for t in many["tokens"]] and many["max_model_len"] == 8192
    assert plain["tokens"] == tokenizer.encode("a b", add_special_tokens=False)
    assert text == {"text": "a b"}
    for error in errors:
        validate("ErrorResponse", error)
    assert [e["error"]["param"] for e in errors] == ["prompt", "model", "tokens", "tokens",
                                                     "extra"]  # fmt: skip


def test_a_recorded_generate_replays_byte_for_byte(tokenizer: Any, tmp_path: Any) -> None:
    from sluice.events.recorder import FileRecorder, Recording
    from sluice.pipeline.token_text import TokenTexts
    from sluice.replay.cli import replay_recording

    def recorded(engine: FakeEngine) -> ServerState:
        state = fake_state(tokenizer, engine)
        state.recorder = FileRecorder(tmp_path)
        return state

    async def step(client: Client, engine: FakeEngine) -> Any:
        body = {"text": ["Sing", "Dance"], "stream": True, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 3, "n": 2}}  # fmt: skip
        return await post(client, "/generate", body)

    received = run(tokenizer, step, state=recorded)
    assert received.count(b"data: ") == 4 * 3 + 1  # each choice's output at each step, [DONE]
    [path] = list(tmp_path.glob("*.jsonl"))
    recording = Recording.from_jsonl(path.read_bytes())
    replayed = anyio.run(replay_recording, recording, tokenizer, TokenTexts(tokenizer), None)
    assert replayed == (200, received)

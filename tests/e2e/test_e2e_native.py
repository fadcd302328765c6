"""SGLang's native worker API on the shared server with the real default model: the
``/generate`` outputs are the same pipeline's as ``/v1/completions`` (exact greedy
text, token ids and logprobs), streamed cumulatively as SGLang streams them; an
in-flight request stops with ``/abort_request``; ``/flush_cache`` forgets cached
prefixes; the report endpoints carry what SGLang's gateway reads and no server path."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import openai
import orjson
import pytest

from sluice.engine.assembly import UNQUANTISED
from sluice.engine.cpu import host_cpu
from tests.conftest import MODELS, REPO, Server
from tests.support.plain_http import get, post, sse_data

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"


def generate(server: Server, body: dict[str, Any], status: int = 200) -> Any:
    reply = post(f"{server.base_url}/generate", body)
    assert reply.status == status, reply.text
    return reply.json()


def stream_generate(
    server: Server, body: dict[str, Any], chunks: list[Any] | None = None
) -> list[Any]:
    """The stream's data frames, appended to ``chunks`` as they arrive."""
    chunks = [] if chunks is None else chunks
    for data in sse_data(f"{server.base_url}/generate", {**body, "stream": True}):
        chunks.append(data if data == "[DONE]" else orjson.loads(data))
    return chunks


def test_generate_is_the_completion_pipeline_with_sglang_shapes(
    server: Server, client: openai.OpenAI, model: str, tokenizer: Any
) -> None:
    completion = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2
    )
    out = generate(
        server,
        {
            "text": PROMPT,
            "return_logprob": True,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0},
        },
    )
    choice = completion.choices[0]
    assert out["text"] == choice.text
    assert tokenizer.decode(out["output_ids"]) == out["text"]
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (
        completion.usage.prompt_tokens,
        12,
    )  # type: ignore[union-attr]
    assert meta["input_token_logprobs"] == []  # logprob_start_len -1: outputs only
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"]
    assert choice.logprobs is not None
    assert [t[2] for t in triples] == choice.logprobs.tokens
    assert [t[0] for t in triples] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)
    assert all(len(top) == 2 and top[0][0] >= top[1][0] for top in meta["output_top_logprobs"])


def test_prompt_logprobs_from_logprob_start_len(server: Server, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT)
    out = generate(
        server,
        {
            "input_ids": ids,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        },
    )
    inputs = out["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in inputs] == ids
    assert inputs[0][0] is None and all(t[0] < 0 for t in inputs[1:])
    assert all(t[2] is None for t in inputs)  # no text unless return_text_in_logprobs
    later = generate(
        server,
        {
            "input_ids": ids,
            "return_logprob": True,
            "logprob_start_len": 2,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        },
    )
    tail = later["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in tail] == ids[2:]
    assert [t[0] for t in tail] == pytest.approx([t[0] for t in inputs[2:]], abs=1e-4)


def test_a_stream_is_cumulative_and_ends_as_the_unary_body(server: Server) -> None:
    body = {
        "text": PROMPT,
        "rid": "cumulative-1",
        "sampling_params": {"max_new_tokens": 10, "temperature": 0},
    }
    unary = generate(server, body)
    chunks = stream_generate(server, body)
    assert chunks[-1] == "[DONE]"
    outputs = chunks[:-1]
    assert len(outputs) >= 2
    for before, after in itertools.pairwise(outputs):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    assert all(o["meta_info"]["finish_reason"] is None for o in outputs[:-1])
    # The unary run cached the prompt for the stream: only that count may differ.
    assert outputs[-1]["meta_info"].pop("cached_tokens") >= unary["meta_info"].pop("cached_tokens")
    assert outputs[-1] == unary


def test_a_batch_and_n_give_a_list_and_a_stop_string_is_matched(server: Server) -> None:
    prompts = [PROMPT, "Once upon a time"]
    batch = generate(
        server,
        {"text": prompts, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "n": 2}},
    )
    alone = [
        generate(server, {"text": p, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
        for p in prompts
    ]
    assert [o["index"] for o in batch] == [0, 1, 2, 3]
    assert [o["text"] for o in batch] == [alone[0]["text"]] * 2 + [alone[1]["text"]] * 2
    stop = alone[0]["text"].split()[1]
    stopped = generate(
        server,
        {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "stop": [stop]},
        },
    )
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in stopped["text"]


def test_abort_request_ends_a_running_generation(server: Server) -> None:
    rid = "abort-me-0001"
    chunks: list[Any] = []
    body = {
        "text": PROMPT,
        "rid": rid,
        "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True},
    }
    reader = threading.Thread(target=stream_generate, args=(server, body, chunks))
    reader.start()
    deadline = time.monotonic() + 60
    while not chunks:  # generating
        assert time.monotonic() < deadline
        time.sleep(0.05)
    duplicate = generate(server, {**body, "stream": False}, status=400)
    assert duplicate["error"]["param"] == "rid"
    assert post(f"{server.base_url}/abort_request", {"rid": rid}).status == 200
    reader.join(60)
    assert chunks[-1] == "[DONE]"
    last = chunks[-2]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < last["meta_info"]["completion_tokens"] < 2000


def test_flush_cache_forgets_cached_prefixes(server: Server) -> None:
    body = {"text": PROMPT * 20, "sampling_params": {"max_new_tokens": 1}}
    generate(server, body)
    assert generate(server, body)["meta_info"]["cached_tokens"] > 0
    flushed = post(f"{server.base_url}/flush_cache")
    assert (flushed.status, flushed.text) == (200, "Cache flushed.\n")
    assert generate(server, body)["meta_info"]["cached_tokens"] == 0


def test_reports_and_tools(server: Server, tokenizer: Any, model: str) -> None:
    base = server.base_url
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/v1/loads"):
        reply = get(base + path)
        assert reply.status == 200, path
        text = reply.text
        assert str(REPO) not in text and str(MODELS) not in text and ".gguf" not in text
    info = get(f"{base}/server_info").json()
    assert (info["served_model_name"], info["model_path"], info["dp_size"]) == (model, model, 1)
    assert info["context_length"] > 0 and info["max_running_requests"] > 0
    assert (info["dtype"], info["device"], info["responses_store"]) == ("float32", "cpu", "sqlite")
    assert info["api_key_required"] is False
    # Sized from the server's open-file limit; the header deadline at its default.
    assert info["max_connections"] >= 1 and info["header_timeout"] == 30.0
    assert info["cpu"] == host_cpu().to_dict()  # the CPU that picked the kernels
    assert info["decode_path"] == {"path": "transformers", "reason": UNQUANTISED}
    assert get(f"{base}/model_info").json()["is_generation"] is True
    loads = get(f"{base}/v1/loads?include=core").json()
    assert loads["dp_rank_count"] == 1 and loads["loads"][0]["dp_rank"] == 0
    assert get(f"{base}/v1/loads?include=lora").status == 400
    assert get(f"{base}/health_generate").status == 200
    tokens = post(f"{base}/tokenize", {"prompt": PROMPT}).json()
    assert tokens["tokens"] == tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    text = post(f"{base}/v1/detokenize", {"tokens": [tokens["tokens"]]}).json()
    assert text == {"text": [PROMPT]}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": "x", "input_ids": [1]}, "input_ids"),
        ({"text": "x", "sampling_params": {"max_tokens": 4}}, "sampling_params.max_tokens"),
        (
            {"text": "x", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}},
            "sampling_params.min_new_tokens",
        ),
        ({"text": "x", "return_hidden_states": True}, "return_hidden_states"),
        ({"text": "x", "priority": 3}, "priority"),
        ({"text": "x", "model": "other-model"}, "model"),
        ({"input_ids": [10**9]}, "input_ids"),
    ],
)
def test_bad_generate_bodies_are_400s_naming_the_field(
    server: Server, body: dict[str, Any], param: str
) -> None:
    error = generate(server, body, status=400)["error"]
    assert error["param"] == param, error

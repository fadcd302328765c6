"""``POST /v1/completions`` end to end: the official ``openai`` SDK against the one shared
test server (the real default model, SmolLM2-135M-Instruct).

Greedy outputs are deterministic, so the expected texts below are exact: they were
read off the server once and hard-coded. Every JSON body and every SSE chunk is
validated against ``CreateCompletionResponse`` from OpenAI's published spec (with the
two documented exceptions explained at :func:`spec_view`). ``max_tokens`` stays small
everywhere: the whole suite shares two CPU cores with the model.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai
import pytest

from tests.openapi import validate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tests.conftest import Server

pytestmark = pytest.mark.model

Body = dict[str, Any]

PARIS = "The capital of France is"  # 5 tokens: [504, 3575, 282, 4649, 314]
PARIS_IDS = [504, 3575, 282, 4649, 314]
PARIS_8 = " Paris.\n\nThe answer is:"  # greedy, max_tokens=8
PARIS_8_TOKENS = [" Paris", ".", "\n", "\n", "The", " answer", " is", ":"]
ONCE = "Once upon a time"  # 4 tokens
ONCE_4 = ", the city of"  # greedy, max_tokens=4
QUESTION = "What is 2+2? Answer:"  # 9 tokens; greedy samples EOS first
EOS_ID = 2  # <|im_end|>
PERIOD_ID = 30  # "."
PARIS_ID = 7042  # " Paris"


# ------------------------------------------------------------------------ helpers


def spec_view(body: Body, *, streamed: bool = False, echo: bool = False) -> Body:
    """``body`` with exactly two documented deviations from the shared schema replaced.

    The spec's ``CreateCompletionResponse`` is shared by the unary body and the stream
    chunks, yet it allows neither of these, which OpenAI itself sends:

    * ``streamed``: a chunk's ``finish_reason`` is ``null`` until the choice's last
      chunk. Only ``null`` is replaced (by the placeholder ``"length"``); a real value is
      validated as sent.
    * ``echo``: the first token of the echoed prompt has no conditional probability,
      so its ``token_logprobs`` and ``top_logprobs`` entries are ``null`` (OpenAI's
      documented behaviour). Only position 0 of a logprobs object whose text offset is
      0 (the start of the echoed text) is replaced (by ``0.0`` and ``{}``).

    Nothing else is touched: every other field is validated exactly as the server sent it.
    """
    view = copy.deepcopy(body)
    for choice in view.get("choices", []):
        if streamed and choice.get("finish_reason", "absent") is None:
            choice["finish_reason"] = "length"
        logprobs = choice.get("logprobs")
        if echo and logprobs and logprobs.get("text_offset", [])[:1] == [0]:
            if logprobs["token_logprobs"][:1] == [None]:
                logprobs["token_logprobs"][0] = 0.0
            if logprobs["top_logprobs"][:1] == [None]:
                logprobs["top_logprobs"][0] = {}
    return view


def check_body(body: Body, *, echo: bool = False) -> Body:
    validate("CreateCompletionResponse", spec_view(body, echo=echo))
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    return body


def check_chunk(chunk: Body, *, echo: bool = False) -> Body:
    validate("CreateCompletionResponse", spec_view(chunk, streamed=True, echo=echo))
    assert chunk["object"] == "text_completion"
    return chunk


def complete(client: openai.OpenAI, **params: Any) -> Body:
    """A unary completion as the exact JSON the server sent, validated."""
    raw = client.completions.with_raw_response.create(**params)
    assert raw.headers["content-type"].startswith("application/json")
    return check_body(json.loads(raw.text), echo=bool(params.get("echo")))


def stream(client: openai.OpenAI, **params: Any) -> list[Body]:
    """A streamed completion as the exact chunks the server sent, each validated.

    Checks the framing too: data-only SSE events, every chunk with the same id and
    ``created``, terminated by ``data: [DONE]``.
    """
    chunks: list[Body] = []
    with client.completions.with_streaming_response.create(stream=True, **params) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line and not line.startswith(":")]
    # Data-only: no ``event:``/``id:`` fields (comment lines, e.g. keep-alives, are fine).
    data = [line for line in lines if line.startswith("data: ")]
    assert data == lines, lines
    assert data[-1] == "data: [DONE]"
    for line in data[:-1]:
        chunks.append(check_chunk(json.loads(line[len("data: ") :]), echo=bool(params.get("echo"))))
    assert chunks
    assert {(c["id"], c["created"]) for c in chunks} == {(chunks[0]["id"], chunks[0]["created"])}
    return chunks


def choice_chunks(chunks: list[Body], index: int = 0) -> list[Body]:
    return [part for chunk in chunks for part in chunk["choices"] if part["index"] == index]


def streamed_text(chunks: list[Body], index: int = 0) -> str:
    return "".join(part["text"] for part in choice_chunks(chunks, index))


def final_part(chunks: list[Body], index: int = 0) -> Body:
    """The one chunk part that finishes choice ``index`` (it must be the last one)."""
    parts = choice_chunks(chunks, index)
    assert [p["finish_reason"] is not None for p in parts] == [False] * (len(parts) - 1) + [True]
    return parts[-1]


def streamed_logprobs(chunks: list[Body], index: int = 0) -> dict[str, list[Any]]:
    merged: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for part in choice_chunks(chunks, index):
        if part["logprobs"] is not None:
            for key, values in merged.items():
                values.extend(part["logprobs"][key])
    return merged


@dataclass(frozen=True)
class RawResponse:
    status: int
    content_type: str
    body: Any


def http(method: str, url: str, data: bytes | None = None) -> RawResponse:
    """A plain HTTP request with no SDK in between: status, content type, decoded JSON."""
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            raw, status, headers = response.read(), response.status, response.headers
    except urllib.error.HTTPError as error:
        raw, status, headers = error.read(), error.code, error.headers
    return RawResponse(status, headers["Content-Type"] or "", json.loads(raw))


def bad_request(client: openai.OpenAI, **params: Any) -> openai.BadRequestError:
    """The SDK's exception for a request the server must refuse with 400."""
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(**params)
    error = raised.value
    assert error.status_code == 400
    assert isinstance(error.body, dict)  # the SDK unwraps the {"error": {...}} envelope
    validate("Error", error.body)
    assert error.body["type"] == "invalid_request_error"
    return error


def check_offsets(text: str, logprobs: dict[str, list[Any]], special: set[str]) -> None:
    """``text_offset`` are real character offsets into ``text``: each normal token starts
    where its offset says; special tokens (no text) sit at the offset they occur."""
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets)
    for token, offset in zip(logprobs["tokens"], offsets, strict=True):
        assert 0 <= offset <= len(text)
        if token not in special:
            assert text[offset:].startswith(token), (token, offset, text)


# ----------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def special(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    return set(tokenizer.all_special_tokens)


@pytest.fixture(scope="module")
def paris_unary(client: openai.OpenAI, model: str) -> Body:
    """The reference greedy completion: max_tokens=8 with 3 alternatives per token."""
    return complete(client, model=model, prompt=PARIS, max_tokens=8, temperature=0, logprobs=3)


# ------------------------------------------------------------ greedy and streaming


def test_greedy_capital_of_france(paris_unary: Body, model: str) -> None:
    assert paris_unary["model"] == model
    [choice] = paris_unary["choices"]
    assert choice["text"].startswith(" Paris")
    assert choice["text"] == PARIS_8
    assert choice["index"] == 0
    assert choice["finish_reason"] == "length"
    assert choice["matched_stop"] is None
    usage = paris_unary["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (5, 8, 13)


def test_greedy_via_sdk_objects(client: openai.OpenAI, model: str) -> None:
    completion = client.completions.create(model=model, prompt=PARIS, max_tokens=8, temperature=0)
    assert completion.object == "text_completion"
    assert completion.choices[0].text == PARIS_8
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 8


def test_stream_adds_up_to_the_unary_text(
    client: openai.OpenAI, model: str, paris_unary: Body
) -> None:
    chunks = stream(client, model=model, prompt=PARIS, max_tokens=8, temperature=0, logprobs=3)
    assert streamed_text(chunks) == paris_unary["choices"][0]["text"]
    assert len(chunks) > 1  # really streamed, not one chunk holding everything
    last = final_part(chunks)
    assert last["finish_reason"] == "length"
    assert all("usage" not in c or c["usage"] is None for c in chunks)  # not asked for

    # Per-chunk logprobs concatenate to the unary ones; offsets stay absolute.
    merged = streamed_logprobs(chunks)
    unary = paris_unary["choices"][0]["logprobs"]
    assert merged["tokens"] == unary["tokens"] == PARIS_8_TOKENS
    assert merged["text_offset"] == unary["text_offset"]
    assert merged["token_logprobs"] == pytest.approx(unary["token_logprobs"], abs=1e-3)
    for streamed_top, unary_top in zip(merged["top_logprobs"], unary["top_logprobs"], strict=True):
        assert streamed_top.keys() == unary_top.keys()


def test_stream_via_sdk(client: openai.OpenAI, model: str) -> None:
    events = client.completions.create(
        model=model, prompt=PARIS, max_tokens=8, temperature=0, stream=True
    )
    texts, reasons = [], []
    for chunk in events:
        for choice in chunk.choices:
            texts.append(choice.text)
            reasons.append(choice.finish_reason)
    assert "".join(texts) == PARIS_8
    assert reasons[-1] == "length"
    assert set(reasons[:-1]) <= {None}


# ------------------------------------------------------------------ prompt shapes


@pytest.mark.parametrize("shape", ["string", "strings", "ids", "id-lists"])
def test_prompt_shapes(
    client: openai.OpenAI, model: str, tokenizer: PreTrainedTokenizerBase, shape: str
) -> None:
    texts = [PARIS, ONCE]
    ids = [tokenizer.encode(text) for text in texts]  # the tokenizer's own count
    assert ids[0] == PARIS_IDS
    prompt: Any = {
        "string": PARIS,
        "strings": texts,
        "ids": ids[0],
        "id-lists": ids,
    }[shape]
    count = 1 if shape in ("string", "ids") else 2
    body = complete(client, model=model, prompt=prompt, max_tokens=4, temperature=0)
    assert [c["text"] for c in body["choices"]] == [" Paris.\n\n", ONCE_4][:count]
    assert [c["index"] for c in body["choices"]] == list(range(count))
    usage = body["usage"]
    assert usage["prompt_tokens"] == sum(len(i) for i in ids[:count])
    assert usage["completion_tokens"] == 4 * count
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_choice_indexing_two_prompts_times_n(client: openai.OpenAI, model: str) -> None:
    body = complete(client, model=model, prompt=[PARIS, ONCE], n=2, max_tokens=4, temperature=0)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    # index = prompt_index * n + j; greedy choices of one prompt are equal.
    assert [c["text"] for c in choices] == [" Paris.\n\n", " Paris.\n\n", ONCE_4, ONCE_4]
    usage = body["usage"]
    assert usage["prompt_tokens"] == 5 + 4  # each prompt counted once, not once per choice
    assert usage["completion_tokens"] == 4 * 4


def test_choice_indexing_when_streamed(client: openai.OpenAI, model: str) -> None:
    chunks = stream(client, model=model, prompt=[PARIS, ONCE], n=2, max_tokens=4, temperature=0)
    texts = [streamed_text(chunks, i) for i in range(4)]
    assert texts == [" Paris.\n\n", " Paris.\n\n", ONCE_4, ONCE_4]
    assert {part["index"] for c in chunks for part in c["choices"]} == {0, 1, 2, 3}
    assert all(len(c["choices"]) == 1 for c in chunks)


# ----------------------------------------------------------------------- logprobs


def test_logprobs_shapes(paris_unary: Body, special: set[str]) -> None:
    [choice] = paris_unary["choices"]
    logprobs = choice["logprobs"]
    completion_tokens = paris_unary["usage"]["completion_tokens"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert len(logprobs[key]) == completion_tokens, key
    assert logprobs["tokens"] == PARIS_8_TOKENS
    for token, logprob, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert 2 <= len(top) <= 4  # 3 alternatives, plus the sampled token if not among them
        assert top[token] == logprob  # the sampled token is in its map, same value
        assert logprob == max(top.values())  # greedy: the sampled token is the argmax
        assert all(v <= 0.0 for v in top.values())
    assert logprobs["top_logprobs"][0] == pytest.approx(
        {" Paris": -0.258, " the": -2.741, " London": -4.384}, abs=0.01
    )
    assert logprobs["text_offset"] == [0, 6, 7, 8, 9, 12, 19, 22]
    check_offsets(choice["text"], logprobs, special)


def test_eos_appears_in_logprobs_but_not_in_text(client: openai.OpenAI, model: str) -> None:
    body = complete(client, model=model, prompt=QUESTION, max_tokens=4, temperature=0, logprobs=1)
    [choice] = body["choices"]
    assert choice["text"] == ""
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", EOS_ID)
    assert choice["logprobs"]["tokens"] == ["<|im_end|>"]
    assert choice["logprobs"]["text_offset"] == [0]
    assert body["usage"]["completion_tokens"] == 1


def test_echo_with_logprobs(
    client: openai.OpenAI, model: str, tokenizer: PreTrainedTokenizerBase, special: set[str]
) -> None:
    body = complete(
        client, model=model, prompt=PARIS, max_tokens=4, temperature=0, echo=True, logprobs=1
    )
    [choice] = body["choices"]
    assert choice["text"] == PARIS + " Paris.\n\n"
    logprobs = choice["logprobs"]
    prompt_tokens = tokenizer.convert_ids_to_tokens(PARIS_IDS)
    assert len(logprobs["tokens"]) == 5 + 4
    assert [tokenizer.convert_tokens_to_string([t]) for t in prompt_tokens] == logprobs["tokens"][
        :5
    ]
    # The first prompt token has no conditional probability: null, as OpenAI sends it.
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in logprobs["token_logprobs"][1:])
    assert all(isinstance(m, dict) and 1 <= len(m) <= 2 for m in logprobs["top_logprobs"][1:])
    # Offsets count the echoed prompt.
    assert logprobs["text_offset"] == [0, 3, 11, 14, 21, 24, 30, 31, 32]
    assert logprobs["text_offset"][5] == len(PARIS)
    check_offsets(choice["text"], logprobs, special)
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["completion_tokens"] == 4


def test_echo_with_zero_max_tokens_scores_the_prompt(client: openai.OpenAI, model: str) -> None:
    body = complete(client, model=model, prompt=PARIS, max_tokens=0, echo=True, logprobs=1)
    [choice] = body["choices"]
    assert choice["text"] == PARIS
    assert choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["The", " capital", " of", " France", " is"]
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(
        [-11.539, -0.338, -2.439, -0.451], abs=0.01
    )
    assert logprobs["text_offset"] == [0, 3, 11, 14, 21]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (5, 0)


def test_echo_streamed(client: openai.OpenAI, model: str) -> None:
    chunks = stream(
        client, model=model, prompt=PARIS, max_tokens=2, temperature=0, echo=True, logprobs=1
    )
    assert streamed_text(chunks) == PARIS + " Paris."
    merged = streamed_logprobs(chunks)
    assert merged["tokens"] == ["The", " capital", " of", " France", " is", " Paris", "."]
    assert merged["token_logprobs"][0] is None
    assert merged["text_offset"] == [0, 3, 11, 14, 21, 24, 30]


# --------------------------------------------------------------------------- stop


def test_stop_string_is_trimmed(client: openai.OpenAI, model: str) -> None:
    completion = client.completions.create(
        model=model, prompt=PARIS, max_tokens=8, temperature=0, stop="answer"
    )
    choice = completion.choices[0]
    assert choice.text == " Paris.\n\nThe "
    assert choice.finish_reason == "stop"
    assert choice.model_extra is not None
    assert choice.model_extra["matched_stop"] == "answer"


def test_stop_string_never_leaks_into_the_stream(client: openai.OpenAI, model: str) -> None:
    # "\n\nThe" spans three tokens: the two newlines must be held back, then dropped.
    params: dict[str, Any] = {"model": model, "prompt": PARIS, "max_tokens": 8, "temperature": 0}
    chunks = stream(client, stop=["\n\nThe", "never"], **params)
    assert streamed_text(chunks) == " Paris."
    assert all("\n" not in part["text"] for part in choice_chunks(chunks))
    last = final_part(chunks)
    assert (last["finish_reason"], last["matched_stop"]) == ("stop", "\n\nThe")

    unary = complete(client, stop=["\n\nThe", "never"], **params)
    assert unary["choices"][0]["text"] == " Paris."
    assert unary["choices"][0]["matched_stop"] == "\n\nThe"
    assert unary["usage"]["completion_tokens"] == 5

    sdk_texts = [
        c.text
        for chunk in client.completions.create(stream=True, stop="answer", **params)
        for c in chunk.choices
    ]
    assert "".join(sdk_texts) == " Paris.\n\nThe "
    assert all("answer" not in t for t in sdk_texts)


def test_no_stop_trim_keeps_the_stop_string(client: openai.OpenAI, model: str) -> None:
    body = complete(
        client,
        model=model,
        prompt=PARIS,
        max_tokens=8,
        temperature=0,
        stop=["\n\nThe"],
        extra_body={"no_stop_trim": True},
    )
    [choice] = body["choices"]
    assert choice["text"] == " Paris.\n\nThe"
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", "\n\nThe")


def test_stop_token_ids(client: openai.OpenAI, model: str) -> None:
    body = complete(
        client,
        model=model,
        prompt=PARIS,
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [PERIOD_ID]},
    )
    [choice] = body["choices"]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", PERIOD_ID)
    assert choice["text"].startswith(" Paris")
    assert body["usage"]["completion_tokens"] == 2


def test_stop_token_is_trimmed_unless_no_stop_trim(client: openai.OpenAI, model: str) -> None:
    params = {"model": model, "prompt": PARIS, "max_tokens": 8, "temperature": 0}
    kept = complete(
        client, extra_body={"stop_token_ids": [PERIOD_ID], "no_stop_trim": True}, **params
    )
    assert kept["choices"][0]["text"] == " Paris."
    trimmed = complete(client, extra_body={"stop_token_ids": [PERIOD_ID]}, **params)
    assert trimmed["choices"][0]["text"] == " Paris"


def test_max_tokens_finishes_with_length(client: openai.OpenAI, model: str) -> None:
    completion = client.completions.create(model=model, prompt=ONCE, max_tokens=3, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    assert choice.model_extra is not None and choice.model_extra["matched_stop"] is None
    assert completion.usage is not None and completion.usage.completion_tokens == 3


# -------------------------------------------------------------------------- usage


def test_include_usage_adds_a_final_usage_chunk(client: openai.OpenAI, model: str) -> None:
    chunks = stream(
        client,
        model=model,
        prompt=[PARIS, ONCE],
        max_tokens=3,
        temperature=0,
        stream_options={"include_usage": True},
    )
    *body, last = chunks
    assert last["choices"] == []
    assert last["usage"]["prompt_tokens"] == 9
    assert last["usage"]["completion_tokens"] == 6
    assert last["usage"]["total_tokens"] == 15
    assert all(c["choices"] and c.get("usage") is None for c in body)


def test_continuous_usage_stats(client: openai.OpenAI, model: str) -> None:
    chunks = stream(
        client,
        model=model,
        prompt=PARIS,
        max_tokens=4,
        temperature=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    *body, last = chunks
    assert last["choices"] == []
    assert all(c["usage"]["prompt_tokens"] == 5 for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in body]
    assert counts == sorted(counts) and counts[0] >= 1
    assert counts[-1] == last["usage"]["completion_tokens"] == 4
    assert all(
        c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
        for c in chunks
    )


def test_continuous_usage_counts_the_eos_token(client: openai.OpenAI, model: str) -> None:
    chunks = stream(
        client,
        model=model,
        prompt=QUESTION,
        max_tokens=4,
        temperature=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    *body, last = chunks
    assert final_part(body)["matched_stop"] == EOS_ID
    assert last["usage"]["completion_tokens"] == 1
    assert body[-1]["usage"]["completion_tokens"] == 1


# ------------------------------------------------------------------------ sampling


def test_seed_makes_sampling_reproducible(client: openai.OpenAI, model: str) -> None:
    def sample(seed: int) -> str:
        body = complete(client, model=model, prompt=PARIS, max_tokens=8, temperature=1, seed=seed)
        text: str = body["choices"][0]["text"]
        return text

    first, again, other = sample(42), sample(42), sample(43)
    assert first == again
    assert first != other  # seeds 42 and 43 sample differently for this prompt
    assert first != PARIS_8  # and seed 42 is not simply the greedy text


def test_best_of_returns_n_choices(client: openai.OpenAI, model: str) -> None:
    body = complete(client, model=model, prompt=PARIS, max_tokens=4, best_of=3, n=1, seed=5)
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] is None  # ranked by logprobs internally, not asked for

    ranked = complete(
        client, model=model, prompt=PARIS, max_tokens=4, best_of=3, n=2, seed=5, logprobs=0
    )
    assert [c["index"] for c in ranked["choices"]] == [0, 1]
    totals = [sum(c["logprobs"]["token_logprobs"]) for c in ranked["choices"]]
    assert totals == sorted(totals, reverse=True)  # the best candidate first


def test_best_of_cannot_stream(client: openai.OpenAI, model: str) -> None:
    error = bad_request(client, model=model, prompt=PARIS, max_tokens=4, best_of=3, stream=True)
    assert error.body["param"] == "best_of"  # type: ignore[index]


def test_top_k_1_is_greedy(client: openai.OpenAI, model: str) -> None:
    body = complete(
        client,
        model=model,
        prompt=PARIS,
        max_tokens=8,
        temperature=1,
        seed=3,
        extra_body={"top_k": 1},
    )
    assert body["choices"][0]["text"] == PARIS_8


def test_min_tokens_holds_back_eos(client: openai.OpenAI, model: str) -> None:
    # Greedy decoding of QUESTION samples EOS first (see the test above).
    body = complete(
        client,
        model=model,
        prompt=QUESTION,
        max_tokens=16,
        temperature=0,
        logprobs=0,
        extra_body={"min_tokens": 2},
    )
    [choice] = body["choices"]
    assert choice["text"] == " 4"
    assert choice["logprobs"]["tokens"] == [" ", "4", "<|im_end|>"]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", EOS_ID)
    assert body["usage"]["completion_tokens"] == 3


def test_ignore_eos_generates_past_eos(client: openai.OpenAI, model: str) -> None:
    body = complete(
        client,
        model=model,
        prompt=QUESTION,
        max_tokens=4,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    [choice] = body["choices"]
    assert choice["logprobs"]["tokens"] == ["<|im_end|>", "\n", "<|im_start|>", "ass"]
    assert choice["text"] == "\nass"  # special tokens skipped from the text
    assert choice["logprobs"]["text_offset"] == [0, 0, 1, 1]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("length", None)
    assert body["usage"]["completion_tokens"] == 4


def test_repetition_penalty_changes_greedy_text(client: openai.OpenAI, model: str) -> None:
    params = {"model": model, "prompt": "1, 2, 3, 4,", "max_tokens": 8, "temperature": 0}
    plain = complete(client, **params)
    penalised = complete(client, extra_body={"repetition_penalty": 1.5}, **params)
    assert plain["choices"][0]["text"] == " 5, 6, 7"
    assert penalised["choices"][0]["text"] == " and so on.\n- The Fib"


def test_logit_bias_forbids_the_greedy_token(client: openai.OpenAI, model: str) -> None:
    body = complete(
        client,
        model=model,
        prompt=PARIS,
        max_tokens=8,
        temperature=0,
        logit_bias={str(PARIS_ID): -100},
    )
    text = body["choices"][0]["text"]
    assert not text.startswith(" Paris")
    assert text == " the capital of the French Republic.\n"


# ------------------------------------------------------------------------- errors


def test_unknown_model(client: openai.OpenAI) -> None:
    error = bad_request(client, model="no-such-model", prompt=PARIS, max_tokens=1)
    assert "The model `no-such-model` does not exist" in error.message
    assert error.code == "model_not_found"
    assert error.param == "model"


def test_temperature_out_of_range(client: openai.OpenAI, model: str) -> None:
    error = bad_request(client, model=model, prompt=PARIS, max_tokens=1, temperature=5)
    assert error.param == "temperature"
    assert "temperature" in error.body["message"]  # type: ignore[index]


@pytest.mark.parametrize("prompt", ["", [], [[]]], ids=["string", "list", "id-list"])
def test_empty_prompt(client: openai.OpenAI, model: str, prompt: Any) -> None:
    error = bad_request(client, model=model, prompt=prompt, max_tokens=1)
    assert error.param == "prompt"
    assert "empty" in error.body["message"]  # type: ignore[index]


def test_prompt_plus_max_tokens_beyond_the_context(client: openai.OpenAI, model: str) -> None:
    error = bad_request(client, model=model, prompt="hello " * 8000, max_tokens=500)
    message: str = error.body["message"]  # type: ignore[index]
    assert error.code == "context_length_exceeded"
    for count in ("8192", "8501", "8001", "500"):  # context, total, prompt, max_tokens
        assert count in message


def test_prompt_alone_beyond_the_context(client: openai.OpenAI, model: str) -> None:
    error = bad_request(client, model=model, prompt="hello " * 9000, max_tokens=1)
    message: str = error.body["message"]  # type: ignore[index]
    assert error.param == "prompt"
    assert "9001 tokens" in message and "8192" in message


def test_suffix_is_refused(client: openai.OpenAI, model: str) -> None:
    error = bad_request(client, model=model, prompt=PARIS, suffix="!", max_tokens=1)
    assert error.param == "suffix"


def test_errors_before_a_stream_are_plain_http_errors(client: openai.OpenAI, model: str) -> None:
    # The SDK raises from create() itself: the server answered with a JSON error, not SSE.
    error = bad_request(client, model="no-such-model", prompt=PARIS, stream=True)
    assert error.response.headers["content-type"].startswith("application/json")
    error = bad_request(client, model=model, prompt=PARIS, temperature=5, stream=True)
    assert error.param == "temperature"


def test_malformed_json(server: Server) -> None:
    response = http("POST", f"{server.v1}/completions", b'{"model": "x", "prompt": ')
    assert response.status == 400
    assert response.content_type.startswith("application/json")
    validate("ErrorResponse", response.body)
    assert response.body["error"]["type"] == "invalid_request_error"
    assert "JSON" in response.body["error"]["message"]


def test_unknown_route(server: Server) -> None:
    response = http("GET", f"{server.v1}/no-such-route")
    assert response.status == 404
    validate("ErrorResponse", response.body)
    assert "/v1/no-such-route" in response.body["error"]["message"]


# -------------------------------------------------------------------- concurrency

BUSY_PROMPTS = (PARIS, ONCE, "def fibonacci(n):", "The quick brown fox", "Hello, my name is")
BUSY_REQUESTS = 64
SEEDED_EVERY = 8  # every 8th request samples with a seed instead of greedy


@dataclass(frozen=True)
class Outcome:
    text: str
    finish_reason: str | None
    tokens: list[str]
    top: list[dict[str, float]]


def busy_params(i: int, model: str) -> dict[str, Any]:
    params: dict[str, Any] = {
        "model": model,
        "prompt": BUSY_PROMPTS[i % len(BUSY_PROMPTS)],
        "max_tokens": 16,
        "logprobs": 2,
    }
    if i % SEEDED_EVERY == SEEDED_EVERY - 1:
        params.update(temperature=1, seed=1000 + i % len(BUSY_PROMPTS))
    else:
        params.update(temperature=0)
    return params


async def run_stream(sdk: openai.AsyncOpenAI, params: dict[str, Any]) -> Outcome:
    """One streamed completion through the SDK; every chunk checked against the schema."""
    text, reason = "", None
    tokens: list[str] = []
    top: list[dict[str, float]] = []
    events = await sdk.completions.create(stream=True, **params)
    async for chunk in events:
        check_chunk(chunk.to_dict())
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens or []
                top += choice.logprobs.top_logprobs or []
    return Outcome(text, reason, tokens, top)


def params_key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True)


@dataclass(frozen=True)
class Burst:
    requests: list[dict[str, Any]]  # the 64 requests' parameters
    alone: dict[str, Outcome]  # each distinct parameter set (by params_key) on an idle server
    busy: list[Outcome | BaseException]  # all 64 at once, in request order


@pytest.fixture(scope="module")
def burst(server: Server, model: str) -> Burst:
    requests = [busy_params(i, model) for i in range(BUSY_REQUESTS)]

    async def main() -> Burst:
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0) as sdk:
            alone = {}
            for params in requests:  # each distinct request once, alone
                if params_key(params) not in alone:
                    alone[params_key(params)] = await run_stream(sdk, params)
            busy = await asyncio.gather(
                *(run_stream(sdk, params) for params in requests), return_exceptions=True
            )
            return Burst(requests, alone, list(busy))

    return asyncio.run(main())


def test_64_concurrent_streams_all_complete(burst: Burst) -> None:
    errors = [o for o in burst.busy if isinstance(o, BaseException)]
    assert errors == []
    outcomes = [o for o in burst.busy if isinstance(o, Outcome)]
    assert len(outcomes) == BUSY_REQUESTS
    assert {o.finish_reason for o in outcomes} == {"length"}
    assert all(len(o.tokens) == 16 for o in outcomes)


def test_same_text_alone_and_in_a_busy_batch(burst: Burst) -> None:
    """Greedy and seeded outputs do not depend on what else is in the batch.

    Batched float arithmetic may legitimately flip a near tie under greedy decoding, so a
    greedy divergence is accepted only if it is numerical: at the first differing token
    both runs' choices are the lone run's top two, within 0.05 nats of each other.
    Seeded requests must match exactly. (When this test was written, all 64 matched.)
    """
    paris = burst.alone[params_key(burst.requests[0])]
    assert paris.text == PARIS_8 + " 2018-01"  # 16 greedy tokens
    for i, (params, outcome) in enumerate(zip(burst.requests, burst.busy, strict=True)):
        assert isinstance(outcome, Outcome)
        alone = burst.alone[params_key(params)]
        if outcome.text == alone.text:
            continue
        assert params["temperature"] == 0, f"seeded request {i} changed in a busy batch"
        k = next(
            j for j, (a, b) in enumerate(zip(alone.tokens, outcome.tokens, strict=True)) if a != b
        )
        top = alone.top[k]
        assert {alone.tokens[k], outcome.tokens[k]} <= top.keys(), (i, k, top)
        first, second = sorted(top.values(), reverse=True)[:2]
        assert math.isclose(first, second, abs_tol=0.05), (
            f"request {i} diverged at token {k} without a near tie: {top}"
        )


# --------------------------------------------------------------------- disconnect


def recording_for(record_dir: Path, marker: str, timeout: float = 60.0) -> list[Body]:
    """The lines of the recording whose request body carries ``user == marker``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in record_dir.glob("*.jsonl"):
            lines = path.read_text(encoding="utf-8").splitlines()
            if not lines:
                continue
            head = json.loads(lines[0])
            if head.get("body", {}).get("user") == marker:
                return [json.loads(line) for line in lines]
        time.sleep(0.5)
    raise AssertionError(f"no recording for user={marker!r} in {record_dir} after {timeout}s")


def sampled_tokens(events: list[Body]) -> int:
    """``TokenSampled`` events in a recording, top level or inside ``EngineBatch`` lines."""
    count = 0
    for event in events:
        if event["type"] == "TokenSampled":
            count += 1
        elif event["type"] == "EngineBatch":
            count += sum(1 for e in event["events"] if e["type"] == "TokenSampled")
    return count


def engine_metric(server: Server, name: str) -> float:
    """One sample from ``/metrics`` (Prometheus text)."""
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing from /metrics:\n{text}")


def test_client_disconnect_stops_the_request(
    server: Server, client: openai.OpenAI, model: str
) -> None:
    marker = f"disconnect-{uuid.uuid4().hex}"
    events = client.completions.create(
        model=model,
        prompt=PARIS,
        max_tokens=2000,
        temperature=0,
        stream=True,
        user=marker,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(events)
    received = [next(chunks), next(chunks)]
    assert all(c.choices and c.choices[0].finish_reason is None for c in received)
    assert engine_metric(server, "sluice_running_sequences") == 1
    events.close()

    # The engine retires the sequence: its batch empties and its step counter stops.
    deadline = time.monotonic() + 60
    while engine_metric(server, "sluice_running_sequences") != 0:
        assert time.monotonic() < deadline, "the disconnected sequence is still running"
        time.sleep(0.1)
    steps = engine_metric(server, "sluice_engine_steps_total")
    time.sleep(1.0)
    assert engine_metric(server, "sluice_engine_steps_total") == steps

    # The recording is written when the request ends. Had the server kept generating,
    # it would appear only after ~2000 engine steps and hold ~2000 sampled tokens.
    recording = recording_for(server.record_dir, marker)
    assert recording[0]["type"] == "Session" and recording[-1]["type"] == "Output"
    assert 2 <= sampled_tokens(recording) < 500
    assert "[DONE]" not in recording[-1]["body"]  # the stream was cut, not finished

    # And the server is fine afterwards.
    after = complete(client, model=model, prompt=PARIS, max_tokens=1, temperature=0)
    assert after["choices"][0]["text"] == " Paris"

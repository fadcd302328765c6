"""``POST /v1/completions`` end to end: the official ``openai`` SDK against the one shared
test server (the real default model, SmolLM2-135M-Instruct).

Greedy outputs are deterministic, so the expected texts below are exact: they were
read off the server once and hard-coded. Every JSON body and every SSE chunk is
validated against ``CreateCompletionResponse`` from OpenAI's published spec (with the
two documented exceptions explained at :func:`spec_view`). ``max_tokens`` stays small
everywhere: the whole suite shares two CPU cores with the model.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import openai
import pytest

from tests.support.e2e_completions import (
    Body,
    bad_request,
    choice_chunks,
    complete,
    stream,
    streamed_text,
)
from tests.support.greedy_pins import ONCE, ONCE_4, PARIS, PARIS_8, QUESTION

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


pytestmark = pytest.mark.model


PARIS_IDS = [504, 3575, 282, 4649, 314]
PARIS_8_TOKENS = [" Paris", ".", "\n", "\n", "The", " answer", " is", ":"]
EOS_ID = 2  # <|im_end|>
PERIOD_ID = 30  # "."
PARIS_ID = 7042  # " Paris"


# ------------------------------------------------------------------------ helpers


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


def test_a_seeded_request_samples_alike_beside_filtered_ones(
    client: openai.OpenAI, model: str
) -> None:
    """Requests with top-p / top-k / min-p sampled in the same steps as one without
    filters: all complete (a batch mixing them had failed every running request), and
    the unfiltered seeded one draws what it draws alone."""

    def plain() -> str:
        body = complete(client, model=model, prompt=PARIS, max_tokens=12, temperature=1, seed=7)
        text: str = body["choices"][0]["text"]
        return text

    def filtered(extra: dict[str, float]) -> str:
        body = complete(
            client, model=model, prompt=QUESTION, max_tokens=12, temperature=0.8, seed=1,
            extra_body={**extra, "ignore_eos": True},
        )  # fmt: skip
        assert body["choices"][0]["finish_reason"] == "length"
        text: str = body["choices"][0]["text"]
        return text

    alone = plain()
    with ThreadPoolExecutor(4) as pool:
        together = pool.submit(plain)
        neighbours = [pool.submit(filtered, extra)
                      for extra in ({"top_p": 0.5}, {"top_k": 3}, {"min_p": 0.2})]  # fmt: skip
        assert together.result() == alone
        for neighbour in neighbours:
            neighbour.result()  # completed, each to its length


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

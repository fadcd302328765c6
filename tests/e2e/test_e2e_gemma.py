"""The second real model, Gemma 3 270M, served end to end through the ``openai`` SDK.

Gemma 3 attends over a 512-token sliding window in five of every six layers, starts
every prompt with BOS and ships no chat template. The long prompt here is 1 006
tokens: before the cache honoured the window it came out as ``'psilon beta …'``.
Expected outputs are exact, and checked against ``model.generate`` on the same weights
loaded in this process. This module starts its own servers, one at a time.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import GEMMA_GGUF, GEMMA_NAME, Server, launch_server, missing_model
from tests.support.e2e_completions import stream as stream_completion
from tests.support.e2e_completions import streamed_text
from tests.support.greedy import greedy_run
from tests.support.greedy_pins import PIN_MARGIN
from tests.support.openapi import validate

pytestmark = pytest.mark.model

FILLER = " ".join(["The quick brown fox jumps over the lazy dog."] * 100)
LONG = FILLER + " The capital of France is"
LONG_ANSWER = " Paris. The capital of France is Paris. The"
LONG_PROMPT_TOKENS = 1006  # BOS included
FOLLOW_UP = LONG + LONG_ANSWER + " And the capital of Italy is"


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if not GEMMA_GGUF.exists():
        missing_model(f"Gemma 3 missing at {GEMMA_GGUF}: run `make model-gemma`")
    with launch_server(GEMMA_GGUF, tmp_path_factory.mktemp("gemma"), GEMMA_NAME) as running:
        yield running


@pytest.fixture(scope="module")
def sdk(gemma: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gemma.v1, api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def reference(gemma: Server) -> tuple[Any, Any]:
    """The converted weights the server serves, loaded here for ``model.generate``."""
    from sluice.engine.loader import load_causal_lm, load_tokenizer, resolve_model

    folder = resolve_model(GEMMA_GGUF).folder  # converted already by the server's start
    return load_tokenizer(folder), load_causal_lm(folder, dtype="float32", device="cpu")


def generate(
    reference: tuple[Any, Any], text: str, n: int, *, add_bos: bool = True
) -> tuple[str, list[float], list[float]]:
    """Greedy text, logprobs and each step's lead over the runner-up (logits);
    ``add_bos=False`` for a prompt that writes its own."""
    tokenizer, model = reference
    run = greedy_run(model, tokenizer(text, add_special_tokens=add_bos).input_ids, n)
    return tokenizer.decode(run.tokens), run.logprobs(), run.margins()


def complete(sdk: openai.OpenAI, prompt: str | list[str], **kw: Any) -> Any:
    return sdk.completions.create(
        model=GEMMA_NAME, prompt=prompt, max_tokens=kw.pop("max_tokens", 10), temperature=0, **kw
    )


def test_a_prompt_longer_than_the_window_equals_generate(
    sdk: openai.OpenAI, reference: tuple[Any, Any]
) -> None:
    raw = sdk.completions.with_raw_response.create(
        model=GEMMA_NAME, prompt=LONG, max_tokens=10, temperature=0
    )
    body = json.loads(raw.text)
    validate("CreateCompletionResponse", body)
    assert body["choices"][0]["text"] == LONG_ANSWER
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == LONG_PROMPT_TOKENS
    text, _, margins = generate(reference, LONG, 10)
    assert text == LONG_ANSWER
    assert min(margins) >= PIN_MARGIN, margins  # a pin that holds on any CPU's kernels


def test_logprobs_are_the_models(sdk: openai.OpenAI, reference: tuple[Any, Any]) -> None:
    out = complete(sdk, LONG, logprobs=2)
    logprobs = out.choices[0].logprobs
    assert "".join(logprobs.tokens) == out.choices[0].text == LONG_ANSWER
    assert logprobs.token_logprobs == pytest.approx(generate(reference, LONG, 10)[1], abs=2e-3)
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 2 and max(top.values()) == pytest.approx(chosen, abs=1e-6)


def test_prefix_reuse_across_the_window(sdk: openai.OpenAI, reference: tuple[Any, Any]) -> None:
    """A prompt that extends an earlier one reuses its 1 000 cached positions, window
    boundary included, and still gets the model's tokens."""
    assert complete(sdk, LONG).choices[0].text == LONG_ANSWER
    out = complete(sdk, FOLLOW_UP, max_tokens=8)
    details = out.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= LONG_PROMPT_TOKENS
    assert out.choices[0].text == generate(reference, FOLLOW_UP, 8)[0]


def test_streaming_equals_unary(sdk: openai.OpenAI) -> None:
    chunks = stream_completion(
        sdk,
        model=GEMMA_NAME,
        prompt=LONG,
        max_tokens=10,
        temperature=0,
        stream_options={"include_usage": True},
    )
    assert streamed_text(chunks) == LONG_ANSWER
    assert chunks[-1]["usage"]["completion_tokens"] == 10


def test_concurrent_prompts_of_other_lengths_keep_their_tokens(
    sdk: openai.OpenAI, reference: tuple[Any, Any]
) -> None:
    """Long and short prompts decoded in one batch, each as alone."""
    prompts = [LONG, "The capital of Italy is", FILLER[:300] + " The dog is", FOLLOW_UP]
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: complete(sdk, p, max_tokens=8), prompts))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.choices[0].text == generate(reference, prompt, 8)[0], prompt[-30:]


def test_chat_without_a_template_is_a_clear_400(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(
            model=GEMMA_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
    assert "no chat template" in caught.value.message
    assert "--chat-template" in caught.value.message


def _card(server: Server) -> dict[str, Any]:
    with urllib.request.urlopen(f"{server.v1}/models/{server.model}", timeout=30) as r:
        card: dict[str, Any] = json.load(r)
    validate("Model", card)
    return card


def test_models_reports_what_the_model_says(gemma: Server) -> None:
    card = _card(gemma)
    assert card["id"] == card["root"] == GEMMA_NAME
    assert card["max_model_len"] == 32768
    assert card["architecture"] == "Gemma3ForCausalLM"
    assert card["eos_token_ids"] == [1]
    assert card["bos_token_id"] == 2 and card["adds_bos_token"] is True
    assert card["attention"] == {
        "layer_types": {"sliding_attention": 15, "full_attention": 3},
        "sliding_window": 512,
        "implementation": "sdpa",
    }
    assert card["chat_template"] is None


def test_the_builtin_gemma_template_makes_chat_work(
    gemma: Server, reference: tuple[Any, Any], tmp_path: Path
) -> None:
    """``--chat-template gemma``: the prompt carries one BOS (the template writes it),
    and the reply is the model's own continuation of the rendered turn. (This is the
    base model, not the instruction-tuned one: it answers a question with a question.)"""
    workdir = tmp_path / "chat"
    workdir.mkdir()
    with (
        launch_server(GEMMA_GGUF, workdir, GEMMA_NAME, "--chat-template", "gemma") as chat,
        openai.OpenAI(base_url=chat.v1, api_key="unused", max_retries=0) as sdk,
    ):
        raw = sdk.chat.completions.with_raw_response.create(
            model=GEMMA_NAME,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12,
            temperature=0,
        )
        body = json.loads(raw.text)
        validate("CreateChatCompletionResponse", body)
        card = _card(chat)
    tokenizer = reference[0]
    assert body["usage"]["prompt_tokens"] == len(
        tokenizer(CHAT_PROMPT, add_special_tokens=False).input_ids
    )
    choice = body["choices"][0]
    assert choice["message"]["content"] == CHAT_ANSWER
    text, _, margins = generate(reference, CHAT_PROMPT, 12, add_bos=False)
    assert text == CHAT_ANSWER
    assert min(margins) >= PIN_MARGIN, margins
    assert choice["finish_reason"] == "length"
    assert card["chat_template"] == "gemma"


CHAT_PROMPT = (
    "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
)
CHAT_ANSWER = "What is the capital of France? mendatang\nWhat is the"

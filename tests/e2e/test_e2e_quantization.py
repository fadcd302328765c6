"""``--quantization w8a8_int8`` end to end with the real default model (fp32 around the
int8 GEMMs): the engine's exact greedy texts, a busy batch within the stated tolerance
of each prompt alone, and the model card saying what is served. One server of its own,
started after the shared one has answered (the two never compute at once)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.conftest import DEFAULT_GGUF, MODEL_NAME, Server, launch_server, missing_model
from tests.support.openapi import validate

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    " ".join(["A long document about rivers, seas and the rain."] * 12),
    "Once upon a time",
]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if not DEFAULT_GGUF.exists():
        missing_model("default model missing: run `make model`")
    workdir = tmp_path_factory.mktemp("quantized")
    with launch_server(DEFAULT_GGUF, workdir, MODEL_NAME, "--quantization", "w8a8_int8") as up:
        yield up


def complete(client: openai.OpenAI, prompt: str) -> str:
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0)
    return out.choices[0].text


def tokens_and_logprobs(client: openai.OpenAI, prompt: str) -> list[tuple[str, float]]:
    out = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, logprobs=0
    )
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
    return list(zip(logprobs.tokens, logprobs.token_logprobs, strict=True))  # type: ignore[arg-type]


def test_greedy_text_is_the_engines_own(quantized: Server) -> None:
    """Not fp32's ' Paris.\n\nThe answer is: …' (bench/quantization.py measures the
    quality cost), and not always ``model.generate``'s on the int8 model either: see
    the tolerance below."""
    with openai.OpenAI(base_url=quantized.v1, api_key="unused", max_retries=0) as client:
        assert complete(client, PROMPTS[0]) == (
            " Paris.\n\nThe United States has a population of approximately 311 million"
            " people.\n\nThe United States"
        )
        assert complete(client, PROMPTS[1]) == (
            "\n    if n == 1:\n        return 1\n    return n * (1 + 1) * (1"
        )


# A row's int8 projections are exact whatever the batch, but attention over a padded
# batch sums in another order, and now and then a last-bit difference moves an
# activation across an int8 rounding step. Measured here: logprobs agree to ~1e-6,
# with jumps of up to ~0.3 after such a step, and greedy texts can part where two
# candidates are that close (fp32 keeps every logprob within ~1e-6). The prefill's
# first token is checked tightly; what follows, only while the texts agree.
FIRST_LOGPROB_TOLERANCE = 1e-3
LATER_LOGPROB_TOLERANCE = 0.5


def test_a_busy_batch_keeps_each_prompts_logprobs_within_the_tolerance(
    quantized: Server,
) -> None:
    with openai.OpenAI(base_url=quantized.v1, api_key="unused", max_retries=0) as client:
        alone = [tokens_and_logprobs(client, prompt) for prompt in PROMPTS]
        assert tokens_and_logprobs(client, PROMPTS[0]) == alone[0]  # alone, repeatable
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: tokens_and_logprobs(client, p), PROMPTS * 2))
    for solo, busy in zip(alone * 2, together, strict=True):
        assert len(busy) == 24
        assert busy[0][0] == solo[0][0]
        assert busy[0][1] == pytest.approx(solo[0][1], abs=FIRST_LOGPROB_TOLERANCE)
        for (token, logprob), (busy_token, busy_logprob) in zip(solo, busy, strict=True):
            if token != busy_token:
                break  # parted at a near-tie: what follows continues another text
            assert busy_logprob == pytest.approx(logprob, abs=LATER_LOGPROB_TOLERANCE)


def test_the_model_card_says_it_is_quantised(quantized: Server, tmp_path: Path) -> None:
    with openai.OpenAI(base_url=quantized.v1, api_key="unused", max_retries=0) as client:
        card = client.models.retrieve(MODEL_NAME).model_dump()
    validate("Model", card)
    assert card["quantization"] == "w8a8_int8"

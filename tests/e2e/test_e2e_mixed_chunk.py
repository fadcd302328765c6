"""``--disable-mixed-chunk`` end to end: a server stepping prefill and decode as two
forwards answers a concurrent burst with exactly the greedy texts of the shared server,
whose steps pack them into one (fp32, the real default model). Each server's burst runs
on its own, so the two engines never compute at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.conftest import DEFAULT_GGUF, MODEL_NAME, Server, launch_server, missing_model
from tests.support.e2e_completions import engine_metric

pytestmark = pytest.mark.model

MIXED = "sluice_mixed_steps_total"

PROMPTS = [
    "The capital of France is",
    # Longer than the 512-token step budget: its chunks are prefilled beside the first
    # prompt's decoding, in steps of their own.
    " ".join(["A long document about rivers, seas and the rain."] * 60),
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colours are",
]


def burst(base_url: str) -> list[str]:
    """The first prompt streamed until it decodes, then the rest sent at once: the
    others are prefilled while it decodes, whatever the machine's speed (sent all at
    once, the long prompt's chunks can take every step until all are prefilled)."""
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:

        def one(prompt: str) -> str:
            out = client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0
            )
            return out.choices[0].text

        stream = client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=64, temperature=0, stream=True
        )
        pieces = [next(iter(stream)).choices[0].text]
        with ThreadPoolExecutor(len(PROMPTS) - 1) as pool:
            rest = pool.map(one, PROMPTS[1:])
            pieces += [chunk.choices[0].text for chunk in stream if chunk.choices]
            return ["".join(pieces), *rest]


def test_separate_forwards_give_the_packed_steps_texts(server: Server, tmp_path: Path) -> None:
    if not DEFAULT_GGUF.exists():
        missing_model("default model missing: run `make model`")
    before = engine_metric(server, MIXED)
    packed = burst(server.v1)
    assert engine_metric(server, MIXED) > before
    with launch_server(DEFAULT_GGUF, tmp_path, MODEL_NAME, "--disable-mixed-chunk") as plain:
        separate = burst(plain.v1)
        assert engine_metric(plain, MIXED) == 0
    assert separate == packed
    assert packed[0].startswith(" Paris")
    assert all(text for text in packed)

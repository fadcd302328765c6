"""What the engine tests against the real default model share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from sluice.engine.loader import load_causal_lm, load_tokenizer, resolve_model
from tests.conftest import DEFAULT_GGUF, missing_model


@pytest.fixture(scope="module")
def loaded() -> Iterator[tuple[Any, Any]]:
    """The default model's tokenizer and its weights in fp32 (the greedy texts the tests
    pin), loaded once per test module."""
    if not DEFAULT_GGUF.exists():
        missing_model("default model missing: run `make model`")
    folder = resolve_model(DEFAULT_GGUF).folder
    yield load_tokenizer(folder), load_causal_lm(folder, dtype="float32", device="cpu")

"""The tokenizer the micro-benchmarks decode with: the default model's, from the cache
``make model`` fills."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

MODELS = Path(__file__).resolve().parents[2] / "models"


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    found = sorted(MODELS.glob("cache/*/tokenizer.json"))
    if not found:
        pytest.skip("no converted model under models/cache: run `make model`")
    return AutoTokenizer.from_pretrained(str(found[0].parent))

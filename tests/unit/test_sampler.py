"""The sampler over a batch of rows with different parameters: each row's token and
logprobs are the ones it gets sampled alone (its own generator, seeded alike), whatever
its neighbours ask for (filters, penalties, greedy)."""

from __future__ import annotations

import random

import pytest
import torch

from sluice.engine.params import SamplingParams
from sluice.engine.sampler import RowState, sample

PARAMS = {
    "greedy": SamplingParams(temperature=0.0, logprobs=1),
    "plain": SamplingParams(temperature=1.0),
    "top_p": SamplingParams(temperature=0.8, top_p=0.5),
    "top_k": SamplingParams(temperature=1.3, top_k=3, logprobs=2),
    "min_p": SamplingParams(temperature=1.0, min_p=0.2),
    "penalised": SamplingParams(temperature=0.7, presence_penalty=1.0),
}
MIXES = [
    ("plain", "top_p"),  # one sampled row filtered, one not
    ("top_p", "greedy", "plain", "min_p"),
    tuple(PARAMS),
]


def _rows(names: tuple[str, ...]) -> list[RowState]:
    return [RowState(PARAMS[n], random.Random(n), (1,), [2, 2, 3]) for n in names]


@pytest.mark.parametrize("names", MIXES, ids="+".join)
def test_each_row_samples_as_it_would_alone(names: tuple[str, ...]) -> None:
    logits = torch.randn(len(names), 64, generator=torch.Generator().manual_seed(5)) * 3
    together = sample(logits, _rows(names))
    for i, name in enumerate(names):
        alone = sample(logits[i : i + 1].clone(), _rows((name,)))
        assert together.tokens[i] == alone.tokens[0], name
        assert together.logprobs[i] == alone.logprobs[0], name

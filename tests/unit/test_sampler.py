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


# What a row brings can still raise inside the batched call: only that row fails.
POISONS = {
    "bias_past_vocab": SamplingParams(temperature=0.0, logit_bias=((64 + 7, 5.0),)),
    "bias_past_int64": SamplingParams(temperature=1.0, logit_bias=((2**70, 5.0),)),
    "stop_id_past_vocab": SamplingParams(
        temperature=0.9, min_tokens=9, stop_token_ids=frozenset({99})
    ),
}


@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("at", [0, 2, 6])
def test_a_row_whose_sampling_raises_fails_alone(poison: str, at: int) -> None:
    names = tuple(PARAMS)
    logits = torch.randn(len(names) + 1, 64, generator=torch.Generator().manual_seed(9)) * 3
    healthy = list(range(len(names) + 1))
    healthy.remove(at)
    clean = sample(logits[healthy].clone(), _rows(names))
    rows = _rows(names)
    poisoned = POISONS[poison]
    bad = RowState(poisoned, random.Random(poison), (1,), [2], stop_ids=poisoned.stop_token_ids)
    rows.insert(at, bad)
    mixed = sample(logits.clone(), rows)
    assert mixed.errors is not None
    assert [e is None for e in mixed.errors] == [i != at for i in range(len(rows))]
    message = mixed.errors[at]
    assert message is not None and message.startswith("sampling failed: ")
    # The others, seeded rows included, drew exactly what they draw without it.
    assert [mixed.tokens[i] for i in healthy] == clean.tokens
    assert [mixed.logprobs[i] for i in healthy] == clean.logprobs


def test_top_k_and_logprobs_past_the_vocabulary_mean_all_of_it() -> None:
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    huge = SamplingParams(temperature=1.0, top_k=2**62, logprobs=2**40)
    whole = SamplingParams(temperature=1.0, top_k=64, logprobs=64)
    result = sample(logits.clone(), [RowState(huge, random.Random(1), (1,))] * 2)
    reference = sample(logits.clone(), [RowState(whole, random.Random(1), (1,))] * 2)
    assert result.errors is None
    assert result.tokens == reference.tokens and result.logprobs == reference.logprobs

"""One sequence must never fail the others it is batched with: the step scheduler over
the real default model, with healthy greedy sequences beside one that brings a value
the step cannot use. The healthy ones generate exactly what ``model.generate`` does;
the poisoned one ends alone, with an error that says why."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.engine.params import SamplingParams, SequenceSpec
from tests.engine.test_engine import PROMPTS, reference, scheduler, spec
from tests.support.choice_events import Events, drain

pytestmark = pytest.mark.model

TOKENS = 10


def healthy(tok: Any, sch: Any, events: Events) -> None:
    for i, text in enumerate(PROMPTS):
        sch.add(spec(tok, f"ok{i}", text, max_tokens=TOKENS, ignore_eos=True), events)


@pytest.fixture(scope="module")
def references(loaded: tuple[Any, Any]) -> list[list[int]]:
    tok, model = loaded
    return [reference(tok, model, text, TOKENS) for text in PROMPTS]


def assert_healthy(references: list[list[int]], events: Events) -> None:
    for i, text in enumerate(PROMPTS):
        assert events.tokens(f"ok{i}") == references[i], text
        assert events.finish(f"ok{i}").reason == "length"
        assert events.finish(f"ok{i}").error is None


@pytest.mark.parametrize(
    "params",
    [
        # Token ids the edge refuses (400), as another way in might still send them.
        SamplingParams(temperature=0.0, logit_bias=((10**12, 1.0),)),
        SamplingParams(temperature=0.7, min_tokens=5, stop_token_ids=frozenset({2**40})),
    ],
    ids=["logit_bias", "stop_token_ids"],
)
@pytest.mark.parametrize("guarded", [True, False], ids=["admission", "sampling"])
def test_a_poisoned_sequence_fails_alone(
    loaded: tuple[Any, Any], references: list[list[int]], params: SamplingParams, guarded: bool
) -> None:
    """``guarded``: the engine refuses the ids at admission; unguarded (no vocabulary
    known at admission), the row's sampling raises mid-batch and only that row ends."""
    tok, model = loaded
    sch = scheduler(model)
    if not guarded:
        sch.vocab_size = None
    events = Events()
    healthy(tok, sch, events)
    # Admitted after the healthy ones have decoded a few steps, so it joins a live batch.
    for _ in range(3):
        sch.step(events)
    sch.add(SequenceSpec("bad", 0, tuple(tok.encode(PROMPTS[0])), params), events)
    drain(sch, events)
    assert_healthy(references, events)
    finish = events.finish("bad")
    assert finish.reason == "abort" and events.tokens("bad") == []
    assert finish.error is not None
    if guarded:
        assert finish.error.startswith("a token id of ")
        assert finish.error.endswith(f"is outside the vocabulary of {sch.vocab_size} tokens")
    else:
        assert finish.error.startswith("sampling failed: IndexError")
    assert sch.running == 0 and not sch.waiting


def test_a_prompt_id_past_the_vocabulary_is_refused_at_admission(
    loaded: tuple[Any, Any], references: list[list[int]]
) -> None:
    """Past the vocabulary a prompt id would fail the forward itself, every row with it."""
    tok, model = loaded
    sch = scheduler(model)
    events = Events()
    healthy(tok, sch, events)
    vocab = int(model.config.vocab_size)
    sch.add(SequenceSpec("bad", 0, (1, 2, vocab), SamplingParams(temperature=0.0)), events)
    drain(sch, events)
    assert_healthy(references, events)
    assert events.finish("bad").error == (
        f"a token id of prompt is outside the vocabulary of {vocab} tokens"
    )

"""Greedy runs of the default model through two decode paths, and the check that one
follows the other: token for token while they agree, and where they part, only at a
near-tie (the bound ``tests/e2e/test_e2e_quantization.py`` uses). GEMMs that sum in
another order, or activations rounded to bfloat16, let a near-tie fall either way."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from sluice.engine.assembly import ModelScheduler
from sluice.engine.params import SamplingParams, SequenceSpec
from sluice.events.types import TokenLogprob, TokenSampled
from tests.support.choice_events import Events, drain

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
LOGPROB_TOLERANCE = 0.5
NEAR_TIE = 2.0  # nats between the two candidates where two texts may part
TOP = 5


def add_prompt(sch: ModelScheduler, tok: Any, events: Events, rid: str, text: str, n: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=TOP)
    sch.add(SequenceSpec(rid, 0, tuple(tok.encode(text)), params), events)


def serve_joining(sch: ModelScheduler, tok: Any, events: Events) -> None:
    """Sequences joining while others decode (their prompts in mixed steps), then a
    long prompt that grows the cache, to the end."""
    add = functools.partial(add_prompt, sch, tok, events)
    add("s0", PROMPTS[0], 16)
    for _ in range(6):
        sch.step(events)
    add("s1", PROMPTS[1], 10)
    for _ in range(4):
        sch.step(events)
    for i in range(2, 5):
        add(f"s{i}", PROMPTS[i % 3] + f" {i}", 6)
    add("long", " ".join(["The river runs to the sea."] * 12), 6)
    drain(sch, events)


def steps_of(events: Events, rid: str) -> list[TokenLogprob]:
    sampled = [e for e in events.by_key[(rid, 0)] if isinstance(e, TokenSampled)]
    assert all(e.logprob is not None for e in sampled)
    return [e.logprob for e in sampled if e.logprob is not None]


def assert_follows(got: list[TokenLogprob], want: list[TokenLogprob]) -> None:
    """``got`` has ``want``'s tokens and logprobs while the two agree; where they part,
    ``got``'s token was within ``NEAR_TIE`` of ``want``'s choice at that step."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.token_id != w.token_id:
            top = dict(w.top)
            assert g.token_id in top, f"step {i}: {g.token_id} is not among {top}"
            assert top[g.token_id] >= w.logprob - NEAR_TIE, f"step {i}: no near-tie: {top}"
            return
        assert g.logprob == pytest.approx(w.logprob, abs=LOGPROB_TOLERANCE), f"step {i}"


def assert_runs_follow(
    got: dict[str, list[TokenLogprob]], want: dict[str, list[TokenLogprob]]
) -> None:
    """Every run of ``serve_joining`` through one path follows the other path's."""
    assert got.keys() == want.keys()
    for rid, steps in want.items():
        assert_follows(got[rid], steps)
    assert len(want["s0"]) == 16

"""N-gram speculative decoding against the real default model (fp32), in process.

Prompts that ask the model to copy text make it repeat what it has seen, so drafts are
long and mostly kept; the speculative engine must still give the plain engine's tokens
exactly: greedy, seeded sampling with penalties, grammars, stops and limits that fall
inside a draft, a prefix cache reused after drafts were cut short, and alongside
prompts being prefilled in the same packed forward."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from sluice.engine.assembly import ModelScheduler, build_scheduler
from sluice.engine.grammar import TokenGrammar
from sluice.engine.params import Constraint, SamplingParams, SequenceSpec
from sluice.engine.scheduler import SchedulerConfig
from sluice.engine.speculative import SpeculativeConfig
from sluice.events.types import TokenSampled
from tests.engine.test_engine import reference
from tests.support.choice_events import Events, drain

pytestmark = pytest.mark.model

RECORD = {
    "id": 4127,
    "name": "Ada Lovelace",
    "born": "1815-12-10",
    "fields": ["mathematics", "computing"],
    "known_for": ["Analytical Engine notes", "first published algorithm"],
}
TEXT = (
    "Ada Lovelace was an English mathematician and writer, chiefly known for her work on "
    "Charles Babbage's proposed mechanical general-purpose computer, the Analytical Engine."
)
ASKS = {
    "json": "Copy this JSON exactly, nothing else:\n" + json.dumps(RECORD),
    "text": "Repeat the following text word for word:\n\n" + TEXT,
}


def chat(tok: Any, ask: str) -> str:
    return str(
        tok.apply_chat_template(
            [{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True
        )
    )


def scheduler(
    model: Any, speculative: bool, grammar: TokenGrammar | None = None, **kw: Any
) -> ModelScheduler:
    kw.setdefault("max_running", 16)
    config = SchedulerConfig(
        context_length=8192,
        speculative=SpeculativeConfig(num_draft_tokens=8) if speculative else None,
        **kw,
    )
    return build_scheduler(
        model, config, eos_token_ids=frozenset({2}), device=torch.device("cpu"), grammar=grammar
    )


def run(
    model: Any, speculative: bool, specs: list[SequenceSpec], **kw: Any
) -> tuple[Events, ModelScheduler]:
    sch, events = scheduler(model, speculative, **kw), Events()
    for s in specs:
        sch.add(s, events)
    drain(sch, events)
    return events, sch


def ask(tok: Any, rid: str, name: str, choice: int = 0, **params: Any) -> SequenceSpec:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 96)
    return SequenceSpec(
        rid, choice, tuple(tok.encode(chat(tok, ASKS[name]))), SamplingParams(**params)
    )


def outputs(events: Events) -> dict[tuple[str, int], list[int]]:
    return {key: events.tokens(*key) for key in events.by_key}


def test_greedy_drafts_give_the_plain_tokens_and_generate(loaded: tuple[Any, Any]) -> None:
    """Copying prompts beside ordinary ones, and a long prompt admitted while they
    decode (drafts verified inside mixed steps): every token and logprob as without
    speculation, the copies as ``model.generate``'s; most drafted tokens are kept."""
    tok, model = loaded
    long_prompt = " ".join(["The river runs to the sea, and the sea to the rain."] * 30)
    runs = []
    for speculative in (False, True):
        sch = scheduler(model, speculative, prefill_chunk=128)
        events = Events()
        sch.add(ask(tok, "json", "json", logprobs=2), events)
        sch.add(ask(tok, "text", "text"), events)
        sch.add(
            SequenceSpec(
                "free",
                0,
                tuple(tok.encode("Once upon a time")),
                SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            ),
            events,
        )
        for _ in range(3):
            sch.step(events)
        sch.add(
            SequenceSpec(
                "long",
                0,
                tuple(tok.encode(long_prompt)),
                SamplingParams(temperature=0.0, max_tokens=12),
            ),
            events,
        )
        drain(sch, events)
        runs.append((events, sch))
    (plain, plain_sch), (spec, spec_sch) = runs
    assert outputs(spec) == outputs(plain)
    lps = [e.logprob for e in spec.by_key[("json", 0)] if isinstance(e, TokenSampled)]
    want = [e.logprob for e in plain.by_key[("json", 0)] if isinstance(e, TokenSampled)]
    for got, expected in zip(lps, want, strict=True):
        assert got is not None and expected is not None
        assert got.token_id == expected.token_id
        assert [t for t, _ in got.top] == [t for t, _ in expected.top]
        assert got.logprob == pytest.approx(expected.logprob, abs=1e-4)
    copied = spec.tokens("json")
    assert tok.decode(copied).startswith(json.dumps(RECORD)[:40])
    assert copied[:-1] == reference(tok, model, chat(tok, ASKS["json"]), len(copied) - 1)
    assert plain_sch.draft_tokens == 0
    assert spec_sch.mixed_steps > 0 and plain_sch.mixed_steps > 0
    assert spec_sch.accepted_tokens > spec_sch.draft_tokens / 2
    assert spec_sch.steps < plain_sch.steps * 0.7


def test_seeded_sampling_draws_the_plain_tokens(loaded: tuple[Any, Any]) -> None:
    """Sampling with a seed, filters, penalties and a logit bias: each choice draws its
    random numbers in the same order with or without drafts, so the tokens are equal."""
    tok, model = loaded
    comma = tok.encode(",")[0]
    params = {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.02,
        "frequency_penalty": 0.2,
        "repetition_penalty": 1.05,
        "logit_bias": ((comma, 1.5),),
        "seed": 11,
    }
    specs = [ask(tok, "s", name, choice=c, **params) for c, name in enumerate(ASKS)]
    specs.append(ask(tok, "s", "json", choice=2, **params))
    plain, _ = run(model, False, specs)
    spec, sch = run(model, True, specs)
    assert outputs(spec) == outputs(plain)
    assert plain.tokens("s", 0) != plain.tokens("s", 2)  # the choices differ
    assert sch.accepted_tokens > 0


def test_stops_and_limits_inside_a_draft(loaded: tuple[Any, Any]) -> None:
    """A stop id, max_tokens and min_tokens that fall in the middle of a kept draft end
    the sequence where the plain engine ends it, with the same reason."""
    tok, model = loaded
    greedy, _ = run(model, False, [ask(tok, "g", "json")])
    copied = greedy.tokens("g")
    stop_at = copied[30]
    first_stop = copied.index(stop_at)
    specs = [
        ask(tok, "stop", "json", stop_token_ids=frozenset({stop_at})),
        ask(tok, "limit", "json", max_tokens=23),
        ask(
            tok,
            "min",
            "json",
            max_tokens=40,
            stop_token_ids=frozenset({stop_at}),
            min_tokens=first_stop + 2,
        ),
    ]
    plain, _ = run(model, False, specs)
    spec, sch = run(model, True, specs)
    assert outputs(spec) == outputs(plain)
    assert spec.tokens("stop") == copied[: first_stop + 1]
    assert spec.finish("stop").reason == "stop" and spec.finish("stop").matched_token == stop_at
    assert len(spec.tokens("limit")) == 23 and spec.finish("limit").reason == "length"
    assert len(spec.tokens("min")) > first_stop + 1
    for rid in ("stop", "limit", "min"):
        assert spec.finish(rid) == plain.finish(rid)
    assert sch.accepted_tokens > 0


def test_a_grammar_masks_every_verified_position(loaded: tuple[Any, Any]) -> None:
    """A JSON-schema constraint: drafts pass through the grammar's mask position by
    position, and the output is the plain constrained output, valid JSON."""
    tok, model = loaded
    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
        "required": ["id", "name"],
        "additionalProperties": False,
    }
    constraint = Constraint("json_schema", json.dumps(schema))
    grammar = TokenGrammar(tok, eos_token_ids=[2])
    specs = [ask(tok, "c", "json", constraint=constraint, max_tokens=64)]
    plain, _ = run(model, False, specs, grammar=grammar)
    spec, sch = run(model, True, specs, grammar=grammar)
    assert spec.tokens("c") == plain.tokens("c")
    text = tok.decode([t for t in spec.tokens("c") if t != 2])
    assert json.loads(text)["name"] == "Ada Lovelace"
    assert sch.constrained == 0 and sch.accepted_tokens > 0


def test_the_prefix_cache_after_drafts_were_cut_short(loaded: tuple[Any, Any]) -> None:
    """A finished speculative sequence leaves in its slot only the KV of tokens it
    kept: a follow-up prompt that extends it reuses that prefix and gets the plain
    engine's tokens."""
    tok, model = loaded
    results = []
    for speculative in (False, True):
        sch = scheduler(model, speculative, max_running=4)
        events = Events()
        first = ask(tok, "first", "text", max_tokens=20)
        sch.add(first, events)
        drain(sch, events)
        follow = first.prompt_ids + tuple(events.tokens("first")) + tuple(tok.encode(" Again:"))
        sch.add(
            SequenceSpec("next", 0, follow, SamplingParams(temperature=0.0, max_tokens=16)), events
        )
        drain(sch, events)
        results.append((events.tokens("next"), events.prompt("next").cached_tokens, sch))
    (plain_tokens, plain_cached, _), (spec_tokens, spec_cached, sch) = results
    assert spec_tokens == plain_tokens
    assert spec_cached == plain_cached > len(ask(tok, "x", "text").prompt_ids)
    assert sch.accepted_tokens > 0

"""Grammar constraints: compile and validate, masks, the sampler, and the scheduler.

Model-free: the default model's tokenizer, and for the scheduler a tiny randomly
initialised Llama over that vocabulary, so the grammar has to overrule a model that
wants arbitrary tokens.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import pytest
import torch

from sluice.engine.assembly import build_scheduler
from sluice.engine.grammar import (
    ConstraintError,
    GrammarMatcher,
    TokenGrammar,
    grammar_for,
    validate_constraint,
)
from sluice.engine.params import Constraint, SamplingParams, SequenceSpec
from sluice.engine.sampler import RowState, sample
from sluice.engine.scheduler import SchedulerConfig
from sluice.events.types import SequenceFinished
from tests.support.choice_events import Events

EOS = 2  # SmolLM2's <|im_end|>
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def grammar(tokenizer: Any) -> TokenGrammar:
    return TokenGrammar(tokenizer, eos_token_ids=[EOS])


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (
            Constraint("json_schema", '{"type": "objec"}'),
            "Invalid JSON schema: Invalid type: objec",
        ),
        (
            Constraint("json_schema", "{nope"),
            "Invalid JSON schema: not valid JSON: Expecting property name enclosed in double "
            "quotes: line 1 column 2 (char 1)",
        ),
        (Constraint("json_schema", "[]"), "Invalid JSON schema: a schema must be a JSON object"),
        (
            Constraint("json_schema", '{"$ref": "#/$defs/missing"}'),
            "Invalid JSON schema: Pointer '/$defs/missing' does not exist",
        ),
        (Constraint("ebnf", 'rule ::= "a"'), "Invalid EBNF grammar: No 'root' rule found"),
        (
            Constraint("lark", 'start: "a" missing'),
            'Invalid Lark grammar: at 1(8): unknown name: "missing"\n'
            '   1 | start: "a" missing\n'
            "              ^",
        ),
    ],
)
def test_invalid_constraints_carry_the_compilers_message(
    constraint: Constraint, message: str
) -> None:
    with pytest.raises(ConstraintError) as raised:
        validate_constraint(constraint)
    assert str(raised.value) == message
    assert raised.value.kind == constraint.kind


def test_an_invalid_regex_names_the_error() -> None:
    with pytest.raises(ConstraintError) as raised:
        validate_constraint(Constraint("regex", "(ab"))
    assert str(raised.value).startswith('Invalid regex: at 1(8): invalid regex "(ab"')
    assert "unclosed group" in str(raised.value)


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint("json_schema", json.dumps(PERSON)),
        Constraint("json_schema", "{}"),
        Constraint("json_object"),
        Constraint("regex", r"\d{3}-[a-z]+"),
        Constraint("ebnf", 'root ::= "yes" | "no"'),
        Constraint(
            "lark",
            'start: TEXT | "<tool_call>" %json{"type": "object"} "</tool_call>"\nTEXT: /[^<]+/',
        ),
    ],
)
def test_valid_constraints_pass(constraint: Constraint) -> None:
    validate_constraint(constraint)
    assert grammar_for(constraint)


# ----------------------------------------------------------------------- masks


def allowed_ids(grammar: TokenGrammar, matcher: GrammarMatcher) -> set[int]:
    row = grammar.allowed([matcher], grammar.vocab_size)[0]
    return set(row.nonzero().flatten().tolist())


def prefix_tokens(tokenizer: Any, words: list[str]) -> set[int]:
    """Every token whose text is a non-empty prefix of one of ``words``."""
    found = set()
    for token in range(len(tokenizer)):
        text = tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token)])
        if (
            text
            and token not in tokenizer.all_special_ids
            and any(w.startswith(text) for w in words)
        ):
            found.add(token)
    return found


def test_the_mask_is_exactly_the_tokens_that_fit(grammar: TokenGrammar, tokenizer: Any) -> None:
    matcher = grammar.matcher(Constraint("regex", "(yes|no)"))
    assert allowed_ids(grammar, matcher) == prefix_tokens(tokenizer, ["yes", "no"])
    assert matcher.consume(ids_of(tokenizer, "ye")[0])
    assert allowed_ids(grammar, matcher) == {ids_of(tokenizer, "s")[0]}
    assert not matcher.accepting
    assert matcher.consume(ids_of(tokenizer, "s")[0])
    # Complete, and nothing may follow: the matcher is stopped and (EOS being the
    # caller's decision) the mask is empty.
    assert matcher.accepting and matcher.stopped
    assert allowed_ids(grammar, matcher) == set()


def test_eos_is_left_to_the_caller(grammar: TokenGrammar, tokenizer: Any) -> None:
    matcher = grammar.matcher(Constraint("regex", "a+"))
    assert matcher.consume(ids_of(tokenizer, "a")[0])
    assert matcher.accepting and not matcher.stopped
    allowed = allowed_ids(grammar, matcher)
    assert EOS not in allowed
    assert ids_of(tokenizer, "a")[0] in allowed


def test_a_rejected_token_is_reported(grammar: TokenGrammar, tokenizer: Any) -> None:
    matcher = grammar.matcher(Constraint("regex", "[0-9]+"))
    assert not matcher.consume(ids_of(tokenizer, "x")[0])
    assert matcher.error is not None and "doesn't satisfy the grammar" in matcher.error


def test_a_grammar_whose_lexer_cannot_take_a_token_is_refused_at_compile(
    grammar: TokenGrammar,
) -> None:
    """It compiles and its first mask is computed; the first token it allows then
    overflows the lexer. Refused by ``prepare`` (what the front end awaits), never
    admitted; a grammar of the same kind that can run is not."""
    with pytest.raises(ConstraintError) as refused:
        grammar.prepare(Constraint("regex", "(a{1000}){1000}")).result()
    assert str(refused.value) == (
        "Invalid regex: the grammar cannot run: lexer error: too many expressions constructed"
    )
    grammar.prepare(Constraint("regex", "(ab){1000}")).result()
    assert grammar.matcher(Constraint("regex", "(ab){1000}")).error is None


def test_a_batch_mask_equals_the_rows_computed_alone(grammar: TokenGrammar, tokenizer: Any) -> None:
    constraints = [
        Constraint("json_schema", json.dumps(PERSON)),
        Constraint("regex", r"[0-9]{3}-[a-z]+"),
        Constraint("ebnf", 'root ::= "The answer is " ("yes" | "no") "."'),
        Constraint("json_object"),
    ]
    advance = ['{"name":"Al', "12", "The answer", ""]
    matchers = []
    for constraint, text in zip(constraints, advance, strict=True):
        m = grammar.matcher(constraint)
        for token in ids_of(tokenizer, text):
            assert m.consume(token)
        matchers.append(m)
    vocab = grammar.vocab_size + 64  # wider than the tokenizer: padding ids never allowed
    batch = grammar.allowed(matchers, vocab)
    assert batch.shape == (4, vocab)
    assert not batch[:, grammar.vocab_size :].any()
    for i, m in enumerate(matchers):
        assert torch.equal(batch[i], grammar.allowed([m], vocab)[0])
    assert allowed_ids(grammar, matchers[1]) == {
        t for t in prefix_tokens(tokenizer, ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"])
    }


def test_matchers_are_independent_and_the_cache_is_bounded(tokenizer: Any) -> None:
    grammar = TokenGrammar(tokenizer, eos_token_ids=[EOS], cache_size=2)
    c = Constraint("regex", "(yes|no)")
    first, second = grammar.matcher(c), grammar.matcher(c)
    assert first.consume(ids_of(tokenizer, "no")[0]) and first.stopped
    assert not second.stopped and allowed_ids(grammar, second)
    grammar.matcher(Constraint("regex", "a"))
    grammar.matcher(Constraint("regex", "b"))
    assert grammar.cached == 2
    with pytest.raises(ConstraintError, match="Invalid regex"):
        grammar.matcher(Constraint("regex", "(("))


# --------------------------------------------------------------------- sampler


def row(grammar: TokenGrammar, constraint: Constraint | None, **params: Any) -> RowState:
    params.setdefault("temperature", 0.0)
    p = SamplingParams(constraint=constraint, **params)
    stop_ids = frozenset() if p.ignore_eos else frozenset({EOS})
    matcher = grammar.matcher(constraint) if constraint is not None else None
    return RowState(p, random.Random(0), (1,), stop_ids=stop_ids, matcher=matcher)


def test_greedy_picks_the_best_allowed_token(grammar: TokenGrammar, tokenizer: Any) -> None:
    vocab = grammar.vocab_size
    logits = torch.zeros(2, vocab)
    hello, no, yes = (
        ids_of(tokenizer, "Hello")[0],
        ids_of(tokenizer, "no")[0],
        ids_of(tokenizer, "yes")[0],
    )
    logits[:, hello] = 10.0
    logits[:, no] = 5.0
    logits[:, yes] = 4.0
    rows = [row(grammar, Constraint("regex", "(yes|no)")), row(grammar, None)]
    result = sample(logits, rows, grammar)
    assert result.tokens == [no, hello]  # the unconstrained row is untouched


def test_logprobs_stay_those_of_the_raw_logits(grammar: TokenGrammar, tokenizer: Any) -> None:
    logits = torch.zeros(1, grammar.vocab_size)
    no = ids_of(tokenizer, "no")[0]
    logits[0, ids_of(tokenizer, "Hello")[0]] = 10.0
    logits[0, no] = 1.0
    rows = [row(grammar, Constraint("regex", "(yes|no)"), logprobs=0)]
    result = sample(logits, rows, grammar)
    expected = torch.log_softmax(logits[0], dim=0)[no].item()
    assert result.tokens == [no]
    assert result.logprobs[0] is not None
    assert result.logprobs[0].logprob == pytest.approx(expected)


def generate(
    grammar: TokenGrammar, state: RowState, *, seed: int, steps: int = 300
) -> tuple[list[int], str]:
    """Drive one row with random logits as the scheduler does; (tokens, how it ended)."""
    gen = torch.Generator().manual_seed(seed)
    assert state.matcher is not None
    for _ in range(steps):
        logits = torch.randn(1, grammar.vocab_size, generator=gen) * 8
        token = sample(logits, [state], grammar).tokens[0]
        state.generated.append(token)
        if token in state.stop_ids:
            return state.generated, "stop"
        assert state.matcher.consume(token), state.matcher.error
        if state.matcher.stopped:
            return state.generated, "grammar"
    return state.generated, "length"


@pytest.mark.parametrize("seed", range(6))
def test_random_logits_are_forced_into_a_schema(
    grammar: TokenGrammar, tokenizer: Any, seed: int
) -> None:
    state = row(grammar, Constraint("json_schema", json.dumps(PERSON)), temperature=1.0)
    state.rng = random.Random(seed)
    tokens, ended = generate(grammar, state, seed=seed)
    assert ended in ("stop", "grammar")
    text = tokenizer.decode([t for t in tokens if t != EOS])
    document = json.loads(text)
    jsonschema.validate(document, PERSON)
    assert text == json.dumps(document, separators=(",", ":"), ensure_ascii=False)


@pytest.mark.parametrize("seed", range(4))
def test_random_logits_are_forced_into_a_regex_and_a_gbnf_grammar(
    grammar: TokenGrammar, tokenizer: Any, seed: int
) -> None:
    state = row(grammar, Constraint("regex", r"[a-c]{2,5}-\d\d"), top_p=0.9, temperature=0.7)
    state.rng = random.Random(seed)
    tokens, _ = generate(grammar, state, seed=seed)
    assert re.fullmatch(r"[a-c]{2,5}-\d\d", tokenizer.decode([t for t in tokens if t != EOS]))
    gbnf = 'root ::= "The answer is " ("yes" | "no") "." [ ]?'
    state = row(grammar, Constraint("ebnf", gbnf))
    tokens, _ = generate(grammar, state, seed=seed)
    assert tokenizer.decode([t for t in tokens if t != EOS]) in {
        "The answer is yes.",
        "The answer is no.",
        "The answer is yes. ",
        "The answer is no. ",
    }


def test_eos_only_where_the_grammar_accepts(grammar: TokenGrammar, tokenizer: Any) -> None:
    a = ids_of(tokenizer, "a")[0]
    logits = torch.zeros(1, grammar.vocab_size)
    logits[0, EOS] = 50.0
    logits[0, a] = 1.0
    state = row(grammar, Constraint("regex", "a{2,}"))
    picks = []
    for _ in range(3):
        token = sample(logits, [state], grammar).tokens[0]
        picks.append(token)
        state.generated.append(token)
        if token == EOS:
            break
        assert state.matcher is not None and state.matcher.consume(token)
    # Not before "aa" is complete; at once after.
    assert tokenizer.decode(picks[:-1]) == "aa" and picks[-1] == EOS


def test_min_tokens_holds_eos_back_inside_the_grammar(
    grammar: TokenGrammar, tokenizer: Any
) -> None:
    a = ids_of(tokenizer, "a")[0]
    logits = torch.full((1, grammar.vocab_size), -5.0)
    logits[0, EOS] = 50.0
    logits[0, a] = 1.0
    state = row(grammar, Constraint("regex", "a+"), min_tokens=3)
    picks = []
    for _ in range(5):
        token = sample(logits, [state], grammar).tokens[0]
        picks.append(token)
        state.generated.append(token)
        if token == EOS:
            break
        assert state.matcher is not None and state.matcher.consume(token)
    assert picks == [a, a, a, EOS]


def test_ignore_eos_never_ends_an_open_grammar(grammar: TokenGrammar, tokenizer: Any) -> None:
    a = ids_of(tokenizer, "a")[0]
    logits = torch.zeros(1, grammar.vocab_size)
    logits[0, EOS] = 50.0
    logits[0, a] = 1.0
    state = row(grammar, Constraint("regex", "a+"), ignore_eos=True)
    for _ in range(4):
        token = sample(logits, [state], grammar).tokens[0]
        assert token == a
        assert state.matcher is not None and state.matcher.consume(token)
        state.generated.append(token)


def test_rows_without_a_grammar_are_not_looked_at(grammar: TokenGrammar) -> None:
    logits = torch.randn(3, grammar.vocab_size, generator=torch.Generator().manual_seed(1))
    rows = [row(grammar, None) for _ in range(3)]
    assert sample(logits, rows, grammar).tokens == logits.argmax(dim=1).tolist()
    assert sample(logits, rows).tokens == logits.argmax(dim=1).tolist()


# ------------------------------------------------------------------- scheduler


@pytest.fixture(scope="module")
def tiny_model(tokenizer: Any) -> Any:
    """A randomly initialised two-layer Llama over the default tokenizer's vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


def run(
    model: Any, grammar: TokenGrammar | None, specs: list[SequenceSpec], **config: Any
) -> Events:
    sch = build_scheduler(
        model,
        SchedulerConfig(max_running=8, context_length=512, **config),
        eos_token_ids=frozenset({EOS}),
        device=torch.device("cpu"),
        grammar=grammar,
    )
    events = Events()
    for s in specs:
        sch.add(s, None)  # type: ignore[arg-type]
    while sch.has_work:
        sch.step(events)
    assert sch.constrained == 0
    return events


def spec(
    tokenizer: Any, rid: str, constraint: Constraint | None, choice: int = 0, **params: Any
) -> SequenceSpec:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 120)
    prompt = tuple(tokenizer.encode("Reply with JSON about a person, please."))
    return SequenceSpec(rid, choice, prompt, SamplingParams(constraint=constraint, **params))


def test_the_scheduler_enforces_grammars_in_one_batch(
    tiny_model: Any, grammar: TokenGrammar, tokenizer: Any
) -> None:
    person = Constraint("json_schema", json.dumps(PERSON))
    specs = [
        spec(tokenizer, "free", None, max_tokens=12),
        spec(tokenizer, "json", person, temperature=1.0, seed=3),
        spec(tokenizer, "json", person, choice=1, temperature=1.0, seed=3),
        spec(tokenizer, "regex", Constraint("regex", r"[a-c]{2,5}-\d\d")),
        spec(tokenizer, "gbnf", Constraint("ebnf", 'root ::= "The answer is " ("yes" | "no")')),
    ]
    # A small prefill chunk: only the last chunk of each prompt samples.
    events = run(tiny_model, grammar, specs, prefill_chunk=5)
    for choice in (0, 1):
        text = tokenizer.decode([t for t in events.tokens("json", choice) if t != EOS])
        jsonschema.validate(json.loads(text), PERSON)
        assert events.finish("json", choice).reason == "stop"
    assert events.tokens("json", 0) != events.tokens("json", 1)  # each choice its own
    assert re.fullmatch(r"[a-c]{2,5}-\d\d", tokenizer.decode(events.tokens("regex")).rstrip())
    gbnf = tokenizer.decode(events.tokens("gbnf"))
    assert gbnf in ("The answer is yes", "The answer is no")
    finish = events.finish("gbnf")
    # Complete: the grammar allows nothing more, so the sequence ends at once.
    assert (finish.reason, finish.matched_token) == ("stop", None)
    assert events.finish("free").reason == "length"


def test_unconstrained_output_is_unchanged_by_constrained_neighbours(
    tiny_model: Any, grammar: TokenGrammar, tokenizer: Any
) -> None:
    alone = run(tiny_model, None, [spec(tokenizer, "free", None, max_tokens=16)])
    busy = run(
        tiny_model,
        grammar,
        [
            spec(tokenizer, "free", None, max_tokens=16),
            spec(tokenizer, "json", Constraint("json_object"), max_tokens=16),
        ],
    )
    assert busy.tokens("free") == alone.tokens("free")
    assert len(alone.tokens("free")) == 16


def test_a_grammar_complete_before_min_tokens_still_ends(
    tiny_model: Any, grammar: TokenGrammar, tokenizer: Any
) -> None:
    events = run(
        tiny_model,
        grammar,
        [spec(tokenizer, "r", Constraint("regex", "(yes|no)"), min_tokens=10, ignore_eos=True)],
    )
    assert tokenizer.decode(events.tokens("r")) in ("yes", "no")
    assert events.finish("r").reason == "stop"


def test_without_a_grammar_a_constrained_sequence_fails_clearly(
    tiny_model: Any, tokenizer: Any
) -> None:
    events = run(tiny_model, None, [spec(tokenizer, "r", Constraint("regex", "a"))])
    finish = events.finish("r")
    assert finish.reason == "abort"
    assert finish.error == "constrained generation needs the engine's tokenizer grammar"
    assert events.tokens("r") == []


def test_other_sequences_step_while_a_grammar_compiles(
    tiny_model: Any, grammar: TokenGrammar, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from concurrent.futures import Future

    gate: Future[Any] = Future()  # the compile, held until the test lets it finish
    monkeypatch.setattr(grammar, "prepare", lambda constraint: gate)
    sch = build_scheduler(
        tiny_model,
        SchedulerConfig(max_running=8, context_length=512),
        eos_token_ids=frozenset({EOS}),
        device=torch.device("cpu"),
        grammar=grammar,
    )
    events = Events()
    sch.add(spec(tokenizer, "slow", Constraint("regex", "(yes|no)")), None)  # type: ignore[arg-type]
    sch.add(spec(tokenizer, "free", None, max_tokens=5), None)  # type: ignore[arg-type]
    while ("free", 0) not in events.by_key or not isinstance(
        events.by_key[("free", 0)][-1], SequenceFinished
    ):
        sch.step(events)
    assert ("slow", 0) not in events.by_key  # still waiting, not admitted
    assert [s.spec.request_id for s in sch.waiting] == ["slow"]
    gate.set_result(None)
    while sch.has_work:
        sch.step(events)
    assert tokenizer.decode(events.tokens("slow")) in ("yes", "no")
    assert events.finish("slow").reason == "stop"


def test_a_compile_error_in_the_engine_fails_only_that_sequence(
    tiny_model: Any, grammar: TokenGrammar, tokenizer: Any
) -> None:
    events = run(
        tiny_model,
        grammar,
        [
            spec(tokenizer, "bad", Constraint("lark", "start: nothing_here")),
            spec(tokenizer, "free", None, max_tokens=3),
        ],
    )
    finish = events.finish("bad")
    assert finish.reason == "abort" and finish.error is not None
    assert finish.error.startswith('Invalid Lark grammar: at 1(8): unknown name: "nothing_here"')
    assert len(events.tokens("free")) == 3

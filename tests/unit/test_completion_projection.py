"""The detokenize stage and the completions projection, with the real tokenizer and
hand-made engine events (no model): stop strings at every token boundary, usage,
logprob offsets, and the unary body as the fold of the stream."""

from __future__ import annotations

from itertools import count
from typing import Any

import pytest

from sluice.engine.params import SamplingParams
from sluice.events.types import (
    ChoiceFinished,
    Completed,
    Delta,
    EngineEvent,
    LifecycleEvent,
    PromptProcessed,
    SequenceFinished,
    TokenLogprob,
    TokenSampled,
    Usage,
)
from sluice.http.projections.completions import CompletionStream, fold_chunks, select_best_of
from sluice.pipeline.detokenize import DetokenizeStage
from sluice.pipeline.job import GenerationJob, Prompt
from sluice.pipeline.token_text import TokenTexts

TEXT = " Paris is the capital.\n\nThe answer is: 42 ✓"


def make_job(**kw: Any) -> GenerationJob:
    base: dict[str, Any] = {
        "request_id": "cmpl-test",
        "created": 1,
        "model": "m",
        "prompts": (Prompt(text="The capital of France is"),),
        "sampling": SamplingParams(max_tokens=64),
    }
    base.update(kw)
    return GenerationJob(**base)


def engine_events(
    ids: list[int], prompt_len: int, *, choice: int = 0, finish: str = "stop", lp: bool = False
) -> list[EngineEvent]:
    seq = count()
    events: list[EngineEvent] = [PromptProcessed("cmpl-test", choice, next(seq), prompt_len, 0)]
    for t in ids:
        logprob = TokenLogprob(t, -0.5, ((t, -0.5), (t + 1, -1.5))) if lp else None
        events.append(TokenSampled("cmpl-test", choice, next(seq), t, logprob))
    matched = 2 if finish == "stop" else None
    events.append(SequenceFinished("cmpl-test", choice, next(seq), finish, len(ids), matched))  # type: ignore[arg-type]
    return events


def run_stage(
    tokenizer: Any, job: GenerationJob, batches: list[list[EngineEvent]]
) -> tuple[list[list[LifecycleEvent]], list[int]]:
    prompt_ids = [tuple(tokenizer.encode(p.text)) for p in job.prompts]
    cancelled: list[int] = []
    stage = DetokenizeStage(
        job, prompt_ids, tokenizer, TokenTexts(tokenizer), cancel_choice=cancelled.append
    )
    return [stage.feed(b) for b in batches], cancelled


def texts_of(batches: list[list[LifecycleEvent]]) -> str:
    return "".join(e.text for b in batches for e in b if isinstance(e, Delta) and not e.is_prompt)


def test_plain_text_round_trips_token_by_token(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT)
    events = engine_events(ids, 5)
    out, cancelled = run_stage(tokenizer, make_job(), [[e] for e in events])
    assert texts_of(out) == TEXT
    finish = [e for b in out for e in b if isinstance(e, ChoiceFinished)]
    assert [(f.finish_reason, f.matched_stop, f.usage) for f in finish] == [
        ("stop", 2, Usage(5, len(ids)))
    ]
    assert isinstance(out[-1][-1], Completed)
    assert cancelled == []


@pytest.mark.parametrize("stop", ["capital", "\n\n", "answer is: 4", " P", "✓"])
def test_stop_string_never_leaks_and_cancels(tokenizer: Any, stop: str) -> None:
    ids = tokenizer.encode(TEXT)
    events = engine_events(ids, 5, finish="length")
    out, cancelled = run_stage(tokenizer, make_job(stop=(stop,)), [[e] for e in events])
    expected = TEXT[: TEXT.index(stop)]
    assert texts_of(out) == expected
    finish = [e for b in out for e in b if isinstance(e, ChoiceFinished)]
    assert len(finish) == 1
    assert (finish[0].finish_reason, finish[0].matched_stop) == ("stop", stop)
    assert cancelled == [0]  # the engine is told to stop stepping the sequence


def test_no_stop_trim_keeps_the_stop(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT)
    out, _ = run_stage(
        tokenizer, make_job(stop=("capital",), no_stop_trim=True), [engine_events(ids, 5)]
    )
    assert texts_of(out) == TEXT[: TEXT.index("capital") + len("capital")]


def test_logprob_offsets_point_into_the_text(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT)
    job = make_job(show_logprobs=True)
    out, _ = run_stage(tokenizer, job, [[e] for e in engine_events(ids, 5, lp=True)])
    stream = CompletionStream("cmpl-test", 1, "m", want_logprobs=True)
    chunks = [c for batch in out for c in stream.project(batch)]
    body = fold_chunks(chunks, stream.usage)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == TEXT
    assert len(lp["tokens"]) == len(ids) == len(lp["text_offset"]) == len(lp["token_logprobs"])
    assert lp["text_offset"] == sorted(lp["text_offset"])
    for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
        if not token.startswith("bytes:"):
            assert TEXT[offset:].startswith(token)
    assert all(len(top) == 2 for top in lp["top_logprobs"])


def test_unary_fold_equals_accumulated_stream(tokenizer: Any) -> None:
    """Two prompts × n=2, interleaved batches: the folded body has exactly the text a
    client accumulates from the chunks, per choice, with the finish of the last chunk."""
    job = make_job(prompts=(Prompt(text="a"), Prompt(text="b")), n=2, show_logprobs=True)
    texts = ["One two three.", " Four", "Five six seven eight", "!"]
    per_choice = [
        engine_events(tokenizer.encode(t), 1, choice=i, lp=True) for i, t in enumerate(texts)
    ]
    batches: list[list[EngineEvent]] = []
    for step in range(max(map(len, per_choice))):
        batches.append([evs[step] for evs in per_choice if step < len(evs)])
    out, _ = run_stage(tokenizer, job, batches)
    stream = CompletionStream("cmpl-test", 1, "m", want_logprobs=True)
    chunks = [c for batch in out for c in stream.project(batch)]
    body = fold_chunks(chunks, stream.usage)

    accumulated: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        assert len(chunk["choices"]) == 1
        part = chunk["choices"][0]
        accumulated[part["index"]] = accumulated.get(part["index"], "") + part["text"]
        if part["finish_reason"] is not None:
            assert part["index"] not in finish, "one finish_reason per choice"
            finish[part["index"]] = part["finish_reason"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [accumulated[i] for i in range(4)] == texts
    assert [c["finish_reason"] for c in body["choices"]] == [finish[i] for i in range(4)]
    n_tokens = sum(len(tokenizer.encode(t)) for t in texts)
    assert body["usage"]["completion_tokens"] == n_tokens
    assert body["usage"]["prompt_tokens"] == 2  # once per prompt, not per choice


def test_best_of_keeps_the_highest_cumulative_logprob() -> None:
    def choice(index: int, lps: list[float]) -> dict[str, Any]:
        logprobs = {"tokens": [], "token_logprobs": lps, "top_logprobs": [], "text_offset": []}
        return {"index": index, "text": str(index), "finish_reason": "length", "logprobs": logprobs}

    body = {
        "choices": [
            choice(0, [-3.0]),
            choice(1, [-0.5, -0.1]),
            choice(2, [-1.0]),
            choice(3, [-0.1]),
            choice(4, [-2.0]),
            choice(5, [-9.0]),
        ]
    }
    picked = select_best_of(body, n=1, best_of=3, keep_logprobs=False)
    assert [(c["index"], c["text"], c["logprobs"]) for c in picked["choices"]] == [
        (0, "1", None),
        (1, "3", None),
    ]

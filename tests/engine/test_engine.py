"""The step-batching engine against the real default model, in process.

Greedy outputs are compared with ``model.generate`` token for token, batched and
alone; sampling, stops, cancellation, prefix reuse and prompt logprobs are checked
through the engine events."""

from __future__ import annotations

import asyncio
import io
import json
from collections import defaultdict
from typing import Any

import pytest
import torch

from sluice.engine.assembly import ModelScheduler, build_scheduler
from sluice.engine.params import SamplingParams, SequenceSpec
from sluice.engine.scheduler import SchedulerConfig
from sluice.engine.sequence import common_prefix_len
from sluice.engine.torch_engine import TorchEngine
from sluice.events.types import EngineEvent, SequenceFinished, TokenSampled
from tests.support.choice_events import Events, drain

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The capital of France is a city",
]


def scheduler(model: Any, **kw: Any) -> ModelScheduler:
    config = SchedulerConfig(max_running=kw.pop("max_running", 16), context_length=8192, **kw)
    return build_scheduler(model, config, eos_token_ids=frozenset({2}), device=torch.device("cpu"))


def spec(tok: Any, rid: str, text: str, choice: int = 0, **params: Any) -> SequenceSpec:
    params.setdefault("temperature", 0.0)
    return SequenceSpec(rid, choice, tuple(tok.encode(text)), SamplingParams(**params))


def reference(tok: Any, model: Any, text: str, n: int) -> list[int]:
    ids = tok(text, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return [int(t) for t in out[0, ids.shape[1] :]]


def test_common_prefix_len() -> None:
    assert common_prefix_len((1, 2, 3), (1, 2, 4)) == 2
    assert common_prefix_len((), (1,)) == 0
    assert common_prefix_len((5, 6), (5, 6)) == 2
    assert common_prefix_len(tuple(range(100)), (*range(63), -1)) == 63


def test_greedy_batch_equals_generate(loaded: tuple[Any, Any]) -> None:
    tok, model = loaded
    sch = scheduler(model)
    events = Events()
    for i, text in enumerate(PROMPTS):
        sch.add(spec(tok, f"r{i}", text, max_tokens=12, ignore_eos=True), events)
    drain(sch, events)
    for i, text in enumerate(PROMPTS):
        assert events.tokens(f"r{i}") == reference(tok, model, text, 12), text
        assert events.finish(f"r{i}").reason == "length"
    assert tok.decode(events.tokens("r0")).startswith(" Paris")


def test_joining_a_busy_batch_keeps_greedy_output(loaded: tuple[Any, Any]) -> None:
    """A sequence admitted while others decode (continuous batching) gets the same tokens
    as alone."""
    tok, model = loaded
    sch = scheduler(model)
    events = Events()
    for i in range(6):
        sch.add(spec(tok, f"busy{i}", f"Story number {i}:", max_tokens=20, ignore_eos=True), events)
    for _ in range(5):
        sch.step(events)
    sch.add(spec(tok, "late", PROMPTS[1], max_tokens=10, ignore_eos=True), events)
    drain(sch, events)
    assert events.tokens("late") == reference(tok, model, PROMPTS[1], 10)


def test_cancel_leaves_the_batch_at_the_next_step(loaded: tuple[Any, Any]) -> None:
    tok, model = loaded
    sch = scheduler(model)
    events = Events()
    sch.add(spec(tok, "long", PROMPTS[2], max_tokens=500, ignore_eos=True), events)
    sch.add(spec(tok, "other", PROMPTS[0], max_tokens=8, ignore_eos=True), events)
    for _ in range(3):
        sch.step(events)
    generated = len(events.tokens("long"))
    sch.cancel("long", None, events)
    sch.step(events)
    assert events.finish("long").reason == "abort"
    assert len(events.tokens("long")) == generated
    drain(sch, events)
    assert events.tokens("other") == reference(tok, model, PROMPTS[0], 8)
    assert sch.running == 0


def test_stop_token_ids_min_tokens_and_max_tokens(loaded: tuple[Any, Any]) -> None:
    tok, model = loaded
    greedy = reference(tok, model, PROMPTS[0], 6)
    sch = scheduler(model)
    events = Events()
    sch.add(
        spec(tok, "stop", PROMPTS[0], max_tokens=20, stop_token_ids=frozenset({greedy[2]})), events
    )
    sch.add(
        spec(
            tok, "min", PROMPTS[0], max_tokens=20, min_tokens=4,
            stop_token_ids=frozenset({greedy[1]}), ignore_eos=True,
        ),
        events,
    )  # fmt: skip
    sch.add(spec(tok, "len", PROMPTS[0], max_tokens=3, ignore_eos=True), events)
    drain(sch, events)
    assert events.tokens("stop") == greedy[:3]
    assert (events.finish("stop").reason, events.finish("stop").matched_token) == (
        "stop",
        greedy[2],
    )
    # The stop id is masked until min_tokens are out, so generation goes on past it.
    assert len(events.tokens("min")) >= 4
    assert greedy[1] not in events.tokens("min")[:3]
    assert len(events.tokens("len")) == 3 and events.finish("len").reason == "length"


def test_seed_reproduces_and_choices_differ(loaded: tuple[Any, Any]) -> None:
    tok, model = loaded
    runs = []
    for _ in range(2):
        sch = scheduler(model)
        events = Events()
        for choice in range(2):
            sch.add(
                spec(tok, "s", PROMPTS[2], choice, max_tokens=16, temperature=1.0, seed=7,
                     ignore_eos=True),
                events,
            )  # fmt: skip
        drain(sch, events)
        runs.append((events.tokens("s", 0), events.tokens("s", 1)))
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]


def test_top_k_one_is_greedy_and_logit_bias_applies(loaded: tuple[Any, Any]) -> None:
    tok, model = loaded
    greedy = reference(tok, model, PROMPTS[0], 4)
    sch = scheduler(model)
    events = Events()
    sch.add(
        spec(tok, "k1", PROMPTS[0], max_tokens=4, temperature=1.0, top_k=1, ignore_eos=True), events
    )
    sch.add(spec(tok, "bias", PROMPTS[0], max_tokens=1, logit_bias=((greedy[0], -100.0),)), events)
    drain(sch, events)
    assert events.tokens("k1") == greedy
    assert events.tokens("bias")[0] != greedy[0]


def test_logprobs_match_the_model(loaded: tuple[Any, Any]) -> None:
    tok, model = loaded
    sch = scheduler(model)
    events = Events()
    sch.add(spec(tok, "lp", PROMPTS[0], max_tokens=2, logprobs=3, ignore_eos=True), events)
    drain(sch, events)
    first = events.by_key[("lp", 0)][1]
    assert isinstance(first, TokenSampled) and first.logprob is not None
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    with torch.inference_mode():
        expected = torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1)
    assert first.logprob.logprob == pytest.approx(float(expected[first.token_id]), abs=1e-3)
    assert len(first.logprob.top) == 3
    assert first.logprob.top[0][0] == first.token_id  # greedy: the chosen is the best


def test_prefix_reuse_and_prompt_logprobs(loaded: tuple[Any, Any]) -> None:
    tok, model = loaded
    sch = scheduler(model)
    events = Events()
    sch.add(spec(tok, "a", PROMPTS[3], max_tokens=2), events)
    drain(sch, events)
    # Same prefix as the finished request: its kept slot is reused.
    sch.add(spec(tok, "b", PROMPTS[3] + " with", max_tokens=4, ignore_eos=True), events)
    # Prompt logprobs need every prompt position computed: no reuse, one entry per token.
    sch.add(spec(tok, "c", PROMPTS[3], max_tokens=0, prompt_logprobs=2), events)
    drain(sch, events)
    n_a = len(tok.encode(PROMPTS[3]))
    assert events.prompt("b").cached_tokens == n_a
    assert events.tokens("b") == reference(tok, model, PROMPTS[3] + " with", 4)
    c = events.prompt("c")
    assert c.cached_tokens == 0 and c.prompt_logprobs is not None
    assert len(c.prompt_logprobs) == n_a and c.prompt_logprobs[0] is None
    assert all(lp is not None and len(lp.top) == 2 for lp in c.prompt_logprobs[1:])
    assert events.tokens("c") == [] and events.finish("c").reason == "length"


def test_many_sequences_through_a_small_cache(loaded: tuple[Any, Any]) -> None:
    """More requests than slots: they queue, run, and all finish with the greedy output."""
    tok, model = loaded
    sch = scheduler(model, max_running=3, free_slots_kept=1)
    events = Events()
    for i in range(7):
        sch.add(spec(tok, f"q{i}", PROMPTS[i % 4], max_tokens=5, ignore_eos=True), events)
    drain(sch, events)
    for i in range(7):
        assert events.tokens(f"q{i}") == reference(tok, model, PROMPTS[i % 4], 5)


def test_engine_thread_delivers_batches_on_the_loop(loaded: tuple[Any, Any]) -> None:
    tok, model = loaded

    async def run() -> dict[str, list[EngineEvent]]:
        engine = TorchEngine(
            model,
            config=SchedulerConfig(max_running=8, context_length=8192),
            eos_token_ids=frozenset({2}),
            threads=2,
        )
        await engine.start()
        got: dict[str, list[EngineEvent]] = defaultdict(list)
        done = asyncio.Event()
        a_done = asyncio.Event()
        loop_thread = asyncio.get_running_loop()

        def sink(batch: Any) -> None:
            assert asyncio.get_running_loop() is loop_thread
            for event in batch:
                got[event.request_id].append(event)
                if isinstance(event, SequenceFinished):
                    (done if event.request_id == "b" else a_done).set()

        engine.submit([spec(tok, "a", PROMPTS[0], max_tokens=1000, ignore_eos=True)], sink)
        engine.submit([spec(tok, "b", PROMPTS[1], max_tokens=6, ignore_eos=True)], sink)
        await asyncio.wait_for(done.wait(), 120)
        engine.cancel("a")
        await asyncio.wait_for(a_done.wait(), 60)
        await engine.close()
        return got

    got = asyncio.run(run())
    b_tokens = [e.token_id for e in got["b"] if isinstance(e, TokenSampled)]
    assert b_tokens == reference(tok, model, PROMPTS[1], 6)
    last = got["a"][-1]
    assert isinstance(last, SequenceFinished) and last.reason == "abort"
    assert last.completion_tokens < 1000


def test_kv_cache_budget_queues_and_refuses(loaded: tuple[Any, Any]) -> None:
    """Under a byte budget of four 256-position slots: small sequences take turns and
    all finish; one that can never fit fails with a clear error instead of waiting."""
    tok, model = loaded
    probe = scheduler(model)
    budget = probe.cache.bytes_for(4, 256)
    sch = scheduler(model, max_running=8, kv_cache_bytes=budget, initial_capacity=256)
    events = Events()
    for i in range(6):
        sch.add(spec(tok, f"s{i}", PROMPTS[0], max_tokens=8, ignore_eos=True), events)
    sch.add(spec(tok, "huge", PROMPTS[0], max_tokens=2000, ignore_eos=True), events)
    drain(sch, events)
    assert sch.cache.bytes_for(sch.cache.slots, sch.cache.capacity) <= budget
    for i in range(6):
        assert events.tokens(f"s{i}") == reference(tok, model, PROMPTS[0], 8)
    huge = events.finish("huge")
    assert huge.reason == "abort" and huge.error is not None and "KV cache" in huge.error


def test_fixed_shape_decode_matches_the_plain_step(loaded: tuple[Any, Any]) -> None:
    """The decode step CUDA graphs capture (padded batch, bucketed read length), run
    eagerly on the CPU: the same greedy tokens as the plain step, while sequences join
    mid-way (batches of 1–7 rows, padded to 1, 2, 4, 8) and one long prompt grows the
    cache under it."""
    tok, model = loaded
    outputs = []
    for fixed in (False, True):
        # Separate forwards: every decode forward is then a fixed-shape one (a mixed
        # step is packed, and never captured).
        sch = scheduler(
            model, max_running=8, initial_capacity=32, fixed_shape_decode=fixed, mixed_chunk=False
        )
        events = Events()
        for i in range(3):
            sch.add(spec(tok, f"s{i}", PROMPTS[i], max_tokens=14, ignore_eos=True), events)
        for _ in range(4):
            sch.step(events)
        for i in range(3, 7):
            sch.add(spec(tok, f"s{i}", f"Item {i}: {PROMPTS[i % 4]}", max_tokens=9), events)
        long_prompt = " ".join(["The river runs to the sea."] * 12)
        sch.add(spec(tok, "long", long_prompt, max_tokens=6, ignore_eos=True), events)
        drain(sch, events)
        assert sch.cache.capacity > 32
        if fixed:
            assert sch.runner.static is not None and sch.runner.static.steps >= 13
        outputs.append({rid: events.tokens(rid) for rid, _ in events.by_key})
    plain, fixed_shape = outputs
    assert fixed_shape == plain
    assert plain["s0"] == reference(tok, model, PROMPTS[0], 14)


def test_first_tokens_are_flushed_before_the_decode_forward(loaded: tuple[Any, Any]) -> None:
    """With separate prefill and decode forwards, a step that finishes a prompt while
    others decode hands its first token out (``flush``) before running the decode
    forward, not a decode step later. (A mixed step has one forward: nothing to flush.)"""
    tok, model = loaded
    sch = scheduler(model, mixed_chunk=False)
    events = Events()
    sch.add(spec(tok, "early", PROMPTS[0], max_tokens=8, ignore_eos=True), events)
    sch.step(events)  # prefilled, and decoded once in the same step
    assert len(events.tokens("early")) == 2
    sch.add(spec(tok, "late", PROMPTS[2], max_tokens=8, ignore_eos=True), events)
    seen_at_flush: list[tuple[int, int]] = []
    sch.step(
        events,
        lambda: seen_at_flush.append((len(events.tokens("early")), len(events.tokens("late")))),
    )
    assert len(events.tokens("early")) == 3
    # At the flush "late" had its first token and "early" not yet its third.
    assert seen_at_flush == [(2, 1)]
    assert len(events.tokens("late")) == 2
    calls: list[int] = []
    sch.step(events, lambda: calls.append(1))  # no prompt finished: no flush
    assert calls == []


def test_bench_worker_runs_the_workload_and_times_each_request(
    loaded: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``engine_only --worker`` (what the bench interleaves with the server's rounds): one
    record per request with its TTFT and the gaps between its tokens; a raw step; an
    unknown request answered with an error, not a crash."""
    from sluice.bench.engine_only import serve_worker

    tok, model = loaded
    requests = [
        {"op": "run", "concurrency": 2, "prompts": PROMPTS[:3], "max_tokens": 5},
        {"op": "ceiling", "batch": 3, "context": 16},
        {"op": "nope"},
    ]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(json.dumps(r) + "\n" for r in requests)))
    assert serve_worker(scheduler(model), tok) == 0
    ready, run, ceiling, unknown = (
        json.loads(line) for line in capsys.readouterr().out.split("\n")[:4]
    )
    assert ready == {"ready": True}
    records = run["records"]
    assert len(records) == 3
    for r in records:
        assert r["error"] is None and r["output_tokens"] == 5 and len(r["itl_s"]) == 4
        assert 0 < r["ttft_s"] < r["latency_s"] <= run["wall_s"]
    assert (ceiling["batch"], ceiling["context"]) == (3, 16) and ceiling["step_s"] > 0
    assert unknown == {"error": "unknown op 'nope'"}


def test_mixed_steps_equal_separate_steps_and_generate(loaded: tuple[Any, Any]) -> None:
    """Prompt chunks packed with the decode rows into one forward: the same greedy
    tokens, logprobs and echo prompt logprobs as separate prefill and decode forwards,
    and as ``model.generate``; prompts longer than the step's 32-token budget are
    admitted over several mixed steps."""
    tok, model = loaded
    outputs = []
    for mixed in (False, True):
        sch = scheduler(model, prefill_chunk=32, mixed_chunk=mixed)
        events = Events()
        for i in range(3):
            sch.add(
                spec(tok, f"s{i}", PROMPTS[i], max_tokens=12, ignore_eos=True, logprobs=2), events
            )
        for _ in range(3):
            sch.step(events)
        long_prompt = " ".join(["The river runs to the sea."] * 12)
        sch.add(spec(tok, "long", long_prompt, max_tokens=6, ignore_eos=True), events)
        sch.add(spec(tok, "echo", PROMPTS[3], max_tokens=3, prompt_logprobs=1), events)
        drain(sch, events)
        assert (sch.mixed_steps >= 3) == mixed
        outputs.append(
            {
                rid: (
                    events.tokens(rid),
                    [e.logprob for e in events.by_key[(rid, 0)] if isinstance(e, TokenSampled)],
                    events.prompt(rid).prompt_logprobs,
                )
                for rid, _ in events.by_key
            }
        )
    separate, mixed_run = outputs
    assert mixed_run.keys() == separate.keys()
    for rid in separate:
        assert mixed_run[rid][0] == separate[rid][0], rid
        for got, want in zip(mixed_run[rid][1], separate[rid][1], strict=True):
            assert (got is None) == (want is None), rid
            if got is not None and want is not None:
                assert got.token_id == want.token_id
                assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        lps, want_lps = mixed_run[rid][2], separate[rid][2]
        assert (lps is None) == (want_lps is None)
        if lps is not None and want_lps is not None:
            assert [lp and lp.token_id for lp in lps] == [lp and lp.token_id for lp in want_lps]
            got_values = [lp.logprob for lp in lps if lp is not None]
            want_values = [lp.logprob for lp in want_lps if lp is not None]
            assert got_values == pytest.approx(want_values, abs=1e-4)
    assert separate["s0"][0] == reference(tok, model, PROMPTS[0], 12)


def test_a_long_prompt_admitted_beside_running_streams_keeps_their_tokens(
    loaded: tuple[Any, Any],
) -> None:
    """Streams decoding while a 700-token prompt is prefilled in mixed steps beside them
    get exactly their tokens alone, and so does the long prompt."""
    tok, model = loaded
    sch = scheduler(model, prefill_chunk=128, mixed_chunk=True)
    events = Events()
    for i in range(4):
        sch.add(spec(tok, f"r{i}", PROMPTS[i], max_tokens=16, ignore_eos=True), events)
    sch.step(events)
    long_prompt = " ".join(["A long document about rivers, seas and the rain."] * 60)
    sch.add(spec(tok, "long", long_prompt, max_tokens=5, ignore_eos=True), events)
    drain(sch, events)
    assert len(tok.encode(long_prompt)) > 600
    assert sch.mixed_steps >= 5
    for i in range(4):
        assert events.tokens(f"r{i}") == reference(tok, model, PROMPTS[i], 16), PROMPTS[i]
    assert events.tokens("long") == reference(tok, model, long_prompt, 5)

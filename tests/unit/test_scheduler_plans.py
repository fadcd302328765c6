"""The scheduler on a scripted runner: no model, so every plan and every event is exact.

``ScriptedRunner`` predicts, at every position, the token after the one there (its
"model" is ``next = (token + 1) % VOCAB``), and records the plans it executes. So a
greedy sequence counts up from its prompt's last token, and what the scheduler
plans (chunks, budgets, slots, drafts, reuse) is checked against the plan itself.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from sluice.engine.kv_cache import SlotKVCache
from sluice.engine.params import SamplingParams, SequenceSpec
from sluice.engine.plan import ForwardKind, StepLogits, StepPlan, StepSamples
from sluice.engine.scheduler import SchedulerConfig, StepScheduler
from sluice.engine.speculative import SpeculativeConfig, verify
from sluice.engine.step_sampler import sample_plan
from sluice.events.types import (
    EngineEvent,
    PromptProcessed,
    SequenceFinished,
    TokenSampled,
)

VOCAB = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def successor(token: int) -> int:
    return (token + 1) % VOCAB


class ScriptedRunner:
    packs = True

    def __init__(self) -> None:
        self.plans: list[StepPlan] = []

    @staticmethod
    def _logits(tokens: list[int]) -> torch.Tensor:
        out = torch.zeros(len(tokens), VOCAB)
        out[range(len(tokens)), [successor(t) for t in tokens]] = 10.0
        return out

    def execute(self, plan: StepPlan) -> StepSamples:
        self.plans.append(plan)
        decode = [t for run in plan.decode for t in run.tokens]
        first = [c.tokens[-1] for c in plan.chunks if c.completes]
        logits = StepLogits(
            decode=self._logits(decode) if plan.decode else None,
            first=self._logits(first) if first else None,
            scored=[
                self._logits(list(c.tokens[: c.scored])) if c.scored else None for c in plan.chunks
            ],
        )
        return sample_plan(plan, logits)


Events = dict[str, list[EngineEvent]]


def make(**config: object) -> tuple[StepScheduler[ScriptedRunner], ScriptedRunner]:
    settings: dict[str, object] = {"max_running": 8, "context_length": 64, "prefill_chunk": 8}
    settings.update(config)
    cache = SlotKVCache.dense(
        layers=1,
        kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
        slots=2,
        capacity=16,
    )
    runner = ScriptedRunner()
    sch = StepScheduler(runner, cache, SchedulerConfig(**settings), eos_token_ids=frozenset({0}))  # type: ignore[arg-type]
    return sch, runner


def add(
    sch: StepScheduler[ScriptedRunner],
    events: Events,
    rid: str,
    prompt: list[int],
    params: SamplingParams = GREEDY,
) -> None:
    sch.add(SequenceSpec(rid, 0, tuple(prompt), params), lambda batch: None)
    events.setdefault(rid, [])


def drain(sch: StepScheduler[ScriptedRunner], events: Events) -> None:
    def emit(_sink: object, event: EngineEvent) -> None:
        events[event.request_id].append(event)

    while sch.has_work:
        sch.step(emit)


def tokens(events: list[EngineEvent]) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenSampled)]


def finish(events: list[EngineEvent]) -> SequenceFinished:
    last = events[-1]
    assert isinstance(last, SequenceFinished)
    return last


def test_greedy_tokens_follow_the_runner_and_length_finishes() -> None:
    sch, runner = make()
    events: Events = {}
    add(sch, events, "a", [3, 4, 5])
    drain(sch, events)
    assert tokens(events["a"]) == [6, 7, 8, 9, 10, 11]
    assert isinstance(events["a"][0], PromptProcessed) and events["a"][0].prompt_tokens == 3
    assert finish(events["a"]).reason == "length"
    assert [e.seq for e in events["a"]] == list(range(len(events["a"])))
    assert [p.kind for p in runner.plans] == [ForwardKind.PREFILL] + [ForwardKind.DECODE] * 5
    # Each decode run writes its last token at the row's next position.
    assert [(r.start, r.tokens) for p in runner.plans[1:] for r in p.decode] == [
        (3 + i, (6 + i,)) for i in range(5)
    ]


def test_eos_stops_and_frees_the_slot() -> None:
    sch, _ = make()
    events: Events = {}
    add(sch, events, "a", [13, 14])  # 15, then 0 (EOS)
    drain(sch, events)
    assert tokens(events["a"]) == [15, 0]
    assert finish(events["a"]).reason == "stop"
    assert sch.running == 0


def test_chunks_keep_the_budget_and_their_slots() -> None:
    sch, runner = make(prefill_chunk=5)
    events: Events = {}
    add(sch, events, "a", list(range(1, 12)))  # 11 tokens: chunks 5, 5, 1
    add(sch, events, "b", [1, 2, 3])
    drain(sch, events)
    for plan in runner.plans:
        assert sum(len(c.tokens) for c in plan.chunks) <= 5
        # Chunks sit after the decode region; decode runs from slot 0.
        assert plan.chunk_slot == len(plan.decode) or plan.kind is ForwardKind.DECODE
    starts = [
        (c.seq.spec.request_id, c.start, len(c.tokens)) for p in runner.plans for c in p.chunks
    ]
    assert starts == [("a", 0, 5), ("a", 5, 5), ("a", 10, 1), ("b", 0, 3)]
    assert tokens(events["a"]) == [12, 13, 14, 15, 0]  # EOS ends it early
    assert tokens(events["b"]) == [4, 5, 6, 7, 8, 9]


def test_a_prompt_arriving_mid_decode_runs_in_a_mixed_forward() -> None:
    sch, runner = make()
    events: Events = {}
    add(sch, events, "a", [1, 2])
    sch.step(lambda _s, e: events[e.request_id].append(e))
    add(sch, events, "b", [5, 6, 7])
    drain(sch, events)
    mixed = [p for p in runner.plans if p.kind is ForwardKind.MIXED]
    assert len(mixed) == 1 and sch.mixed_steps == 1
    assert [r.seq.spec.request_id for r in mixed[0].decode] == ["a"]
    assert [c.seq.spec.request_id for c in mixed[0].chunks] == ["b"] and mixed[0].chunk_slot == 1
    assert tokens(events["a"]) == [3, 4, 5, 6, 7, 8]
    assert tokens(events["b"]) == [8, 9, 10, 11, 12, 13]


def test_without_packing_a_prefill_then_a_decode_that_the_new_row_joins() -> None:
    sch, runner = make()
    runner.packs = False
    events: Events = {}
    add(sch, events, "a", [1, 2])
    sch.step(lambda _s, e: events[e.request_id].append(e))
    add(sch, events, "b", [5, 6, 7])
    flushed: list[int] = []
    sch.step(
        lambda _s, e: events[e.request_id].append(e), lambda: flushed.append(len(runner.plans))
    )
    assert [p.kind for p in runner.plans[-2:]] == [ForwardKind.PREFILL, ForwardKind.DECODE]
    assert flushed == [len(runner.plans) - 1]  # between the two forwards
    assert [r.seq.spec.request_id for r in runner.plans[-1].decode] == ["a", "b"]


def test_a_shared_prefix_is_reused_and_reported() -> None:
    sch, runner = make()
    events: Events = {}
    add(sch, events, "a", [1, 2, 3, 4, 5, 6])
    drain(sch, events)
    add(sch, events, "b", [1, 2, 3, 4, 9])
    drain(sch, events)
    chunk = next(c for p in runner.plans for c in p.chunks if c.seq.spec.request_id == "b")
    assert (chunk.start, chunk.tokens) == (4, (9,))
    processed = events["b"][0]
    assert isinstance(processed, PromptProcessed) and processed.cached_tokens == 4
    assert tokens(events["b"]) == [10, 11, 12, 13, 14, 15]
    assert sch.cached_tokens == 4 and sch.prompt_tokens == 11


def test_cancel_retires_a_running_and_a_waiting_sequence() -> None:
    sch, _ = make(max_running=1)
    events: Events = {}
    add(sch, events, "a", [1, 2])
    add(sch, events, "b", [1, 2])
    emit = lambda _s, e: events[e.request_id].append(e)  # noqa: E731
    sch.step(emit)  # a's prefill, then its first decode: two tokens
    sch.cancel("b", None, emit)  # still waiting: ends at once
    assert finish(events["b"]).reason == "abort" and tokens(events["b"]) == []
    sch.cancel("a", None, emit)  # running: ends at the next step
    sch.step(emit)
    assert finish(events["a"]).reason == "abort" and tokens(events["a"]) == [3, 4]
    assert not sch.has_work


def test_prompt_logprobs_score_every_prompt_position_across_chunks() -> None:
    sch, runner = make(prefill_chunk=3)
    events: Events = {}
    prompt = [4, 5, 9, 7, 8]
    add(sch, events, "a", prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    drain(sch, events)
    assert [c.scored for p in runner.plans for c in p.chunks] == [3, 1]
    processed = events["a"][0]
    assert isinstance(processed, PromptProcessed) and processed.prompt_logprobs is not None
    lps = processed.prompt_logprobs
    assert lps[0] is None and len(lps) == len(prompt)
    # The runner is sure of each successor: 5 after 4 and 8 after 7; 9 after 5 is not.
    assert [lp.token_id for lp in lps[1:] if lp is not None] == prompt[1:]
    sure = [lp.logprob > -1e-3 for lp in lps[1:] if lp is not None]
    assert sure == [True, False, False, True]


def test_drafts_are_verified_and_change_nothing() -> None:
    plain, _ = make()
    spec_sch, runner = make(speculative=SpeculativeConfig(num_draft_tokens=4, min_window=1))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = {}
    for name, sch in (("plain", plain), ("speculative", spec_sch)):
        events: Events = {}
        add(sch, events, "a", [1, 2, 3], params)
        drain(sch, events)
        results[name] = tokens(events["a"])
    # The sequence counts round VOCAB, so after one lap every draft is right.
    assert results["speculative"] == results["plain"] == [(3 + i) % VOCAB for i in range(1, 41)]
    assert any(p.drafted for p in runner.plans)
    assert spec_sch.accepted_tokens > 0 and spec_sch.accepted_tokens == spec_sch.draft_tokens
    assert spec_sch.steps < plain.steps


def test_events_of_concurrent_sequences_stay_in_their_own_order() -> None:
    sch, _ = make(prefill_chunk=4)
    events: Events = {}
    for i in range(5):
        add(sch, events, f"r{i}", list(range(1, 3 + i)))
    drain(sch, events)
    counts = defaultdict(int)
    for rid, evs in events.items():
        assert [e.seq for e in evs] == list(range(len(evs)))
        counts[finish(evs).reason] += 1
        last = int(rid[1:]) + 2
        assert tokens(evs)[0] == last + 1
    assert sum(counts.values()) == 5


def test_verify_keeps_each_draft_up_to_its_first_miss() -> None:
    drafts = [[5, 6, 7], [1], [], [3, 3]]
    # Logit rows per position: row 0 at 0..3, row 1 at 4..5, row 2 at 6, row 3 at 7..9.
    sampled = {0: 5, 1: 6, 2: 8, 4: 2, 6: 9, 7: 3, 8: None}
    calls: list[tuple[list[int], list[int]]] = []

    def sample(rows: list[int], at: list[int]) -> list[int | None]:
        calls.append((rows, at))
        return [sampled[a] for a in at]

    # Row 3 finished at its second position (None): nothing more is sampled for it.
    assert verify(drafts, sample) == [2, 0, 0, 1]
    assert calls == [([0, 1, 2, 3], [0, 4, 6, 7]), ([0, 3], [1, 8]), ([0], [2])]


def test_seeded_sampling_with_drafts_gives_the_plain_tokens() -> None:
    """Drafts often missed (a hot temperature over the runner's sure successor): each
    kept position was sampled as one plain step would sample it, with the penalties of
    the draft before it, and the generator is rewound past the positions thrown away."""
    params = SamplingParams(
        temperature=3.0, seed=7, max_tokens=60, ignore_eos=True, frequency_penalty=0.5
    )
    results = {}
    for name, speculative in (("plain", None), ("speculative", SpeculativeConfig(4, 1))):
        sch, _ = make(speculative=speculative)
        events: Events = {}
        add(sch, events, "a", [1, 2, 3], params)
        drain(sch, events)
        results[name] = (tokens(events["a"]), sch)
    drafted = results["speculative"][1]
    assert 0 < drafted.accepted_tokens < drafted.draft_tokens  # some drafts missed
    assert results["speculative"][0] == results["plain"][0]
    assert len(set(results["plain"][0])) > 4  # it did not just count up

"""``--dp-size`` without a model: the wire codec (every spec field and engine event type
round-trips), the router's choices, and the front end's supervision over real worker
processes (``bench/synthetic_worker.py``): requests spread over workers, a worker killed
with SIGKILL fails only its own sequences with an error, is started again, and the
server keeps serving; ``/health`` and ``/metrics`` say so."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from sluice.dataparallel import frontend as data_parallel
from sluice.dataparallel import wire
from sluice.dataparallel.frontend import DataParallelEngine, WorkerStartError
from sluice.dataparallel.routing import Balance, CacheAwareRouter, Load
from sluice.engine.params import Constraint, SamplingParams, SequenceSpec
from sluice.events.types import (
    EngineEvent,
    PromptProcessed,
    SequenceFinished,
    TokenLogprob,
    TokenSampled,
)
from sluice.http.app import create_app
from sluice.http.state import ServerState
from sluice.pipeline.runner import PipelineContext
from sluice.pipeline.token_text import TokenTexts
from tests.support.fake_engine import MODEL

# ----------------------------------------------------------------------------- wire


SPECS = [
    SequenceSpec("r1", 0, (1, 2, 3)),
    SequenceSpec(
        "r2",
        3,
        (9,),
        SamplingParams(
            max_tokens=7,
            temperature=0.7,
            top_p=0.9,
            top_k=4,
            min_p=0.1,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.2,
            logit_bias=((3, -1.5), (8, 2.0)),
            seed=-42,
            min_tokens=2,
            stop_token_ids=frozenset({2, 11}),
            ignore_eos=True,
            logprobs=3,
            prompt_logprobs=1,
            constraint=Constraint("json_schema", '{"type": "object"}'),
        ),
    ),
    SequenceSpec("r3", 1, (4,), SamplingParams(constraint=Constraint("json_object"))),
]
EVENTS: list[EngineEvent] = [
    PromptProcessed("r1", 0, 0, 3, 1),
    PromptProcessed("r2", 3, 0, 1, 0, prompt_logprobs=(None, TokenLogprob(4, -0.5, ((4, -0.5),)))),
    TokenSampled("r1", 0, 1, 17),
    TokenSampled("r2", 3, 1, 5, TokenLogprob(5, -0.25, ((5, -0.25), (6, -1.75)))),
    SequenceFinished("r1", 0, 2, "stop", 1, matched_token=17),
    SequenceFinished("r2", 3, 2, "length", 7),
    SequenceFinished("r3", 1, 0, "abort", 0, error="boom"),
]


def unframe(data: bytes) -> dict[str, Any]:
    (size,) = wire.HEADER.unpack(data[: wire.HEADER.size])
    assert len(data) == wire.HEADER.size + size
    return wire.parse(data[wire.HEADER.size :])


def test_every_spec_field_round_trips() -> None:
    message = unframe(wire.submit_frame(SPECS))
    assert message["t"] == "submit"
    assert [wire.spec_from_dict(d) for d in message["specs"]] == SPECS


def test_every_engine_event_type_round_trips_with_the_stats() -> None:
    from sluice.engine.interface import EngineStats

    stats = EngineStats(running=2, waiting=1, steps=9, mixed_steps=3, generated_tokens=8,
                        prompt_tokens=5, cached_tokens=1, kv_cache_bytes=1024)  # fmt: skip
    events, decoded = wire.events_of(unframe(wire.events_frame(EVENTS, stats)))
    assert events == EVENTS and decoded == stats


def test_frames_of_another_version_or_kind_are_refused() -> None:
    with pytest.raises(wire.WireError):
        wire.parse(b'{"v": 99, "t": "submit"}')
    with pytest.raises(wire.WireError):
        wire.parse(b"\x00garbage")
    lifecycle = {"v": wire.VERSION, "t": "events", "stats": {},
                 "events": [{"type": "Cancelled", "request_id": "r", "choice_index": 0,
                             "seq": 0, "reason": "x"}]}  # fmt: skip
    with pytest.raises(wire.WireError):
        wire.events_of(lifecycle)


def test_model_facts_round_trip() -> None:
    import torch

    from sluice.engine.attention import AttentionLayout
    from sluice.engine.model_facts import ModelFacts

    facts = ModelFacts("Gemma3ForCausalLM", 32768, frozenset({1, 106}), 2, True,
                       AttentionLayout(("sliding_attention", "full_attention"), 512, torch.float32),
                       "w8a8_int8")  # fmt: skip
    assert wire.facts_from_dict(wire.facts_to_dict(facts)) == facts


# --------------------------------------------------------------------------- router


def test_least_load_is_waiting_times_four_plus_running() -> None:
    router = CacheAwareRouter(3)
    loads = {0: Load(running=3, waiting=1), 1: Load(running=6, waiting=0), 2: Load(2, 2)}
    assert router.choose((1, 2), loads) == 1  # scores 7, 6, 10
    assert router.choose((1, 2), {0: Load(0, 2), 1: Load(7, 0)}) == 1
    assert router.choose((1, 2), {1: Load(0, 0), 2: Load(0, 0)}) == 1  # ties: lowest rank
    with pytest.raises(ValueError):
        router.choose((1,), {})


def test_a_request_follows_its_cached_prefix_unless_its_worker_is_overloaded() -> None:
    router = CacheAwareRouter(2, balance=Balance(abs_threshold=4, rel_threshold=1.5))
    shared = tuple(range(100))
    router.sent(1, (*shared, 500))
    near = {0: Load(0, 0), 1: Load(4, 0)}
    assert router.choose((*shared, 900), near) == 1  # the prefix beats a lighter load
    assert router.choose((7, 8), near) == 0  # nothing cached anywhere: least load
    assert router.choose((*shared[:40], *range(500, 560)), near) == 0  # under half: least
    # Overloaded: more than 4 in flight beyond the least busy, and more than 1.5 × it.
    assert router.choose((*shared, 900), {0: Load(0, 0), 1: Load(5, 0)}) == 0
    assert router.choose((*shared, 900), {0: Load(3, 1), 1: Load(3, 6)}) == 0  # waiting counts
    assert router.choose((*shared, 900), {0: Load(20, 0), 1: Load(25, 0)}) == 1  # < 1.5 ×
    assert router.choose((*shared, 900), {0: Load(20, 0), 1: Load(31, 0)}) == 0
    router.forget(1)
    assert router.choose((*shared, 900), near) == 0
    plain = CacheAwareRouter(2, affinity=False)
    plain.sent(1, shared)
    assert plain.choose(shared, near) == 0


def test_a_burst_sharing_a_system_prompt_spreads_once_past_the_threshold() -> None:
    """The case that starved a worker: 16, then 64, requests whose prompts share a long
    prefix arrive before any finishes."""
    for burst in (16, 64):
        router = CacheAwareRouter(2)
        system = tuple(range(120))
        in_flight = {0: 0, 1: 0}
        for i in range(burst):
            loads = {rank: Load(0, n) for rank, n in in_flight.items()}
            rank = router.choose((*system, 1000 + i), loads)
            router.sent(rank, (*system, 1000 + i))
            in_flight[rank] += 1
        high, low = max(in_flight.values()), min(in_flight.values())
        assert low > 0 and high <= 2 * low, in_flight


def test_a_routing_key_keeps_its_worker_while_it_is_not_overloaded() -> None:
    router = CacheAwareRouter(2)
    idle = {0: Load(0, 0), 1: Load(0, 0)}
    assert router.choose((1, 2, 3), {0: Load(1, 0), 1: Load(0, 0)}, key="user-a") == 1
    # The key wins over a tie that would pick rank 0 and over another cached prefix.
    router.sent(0, (9, 9, 9, 9))
    assert router.choose((9, 9, 9, 9, 5), idle, key="user-a") == 1
    assert router.choose((4, 4), {0: Load(0, 0), 1: Load(4, 0)}, key="user-a") == 1
    # Overloaded: the key moves to the least loaded worker, and stays there.
    assert router.choose((4, 4), {0: Load(0, 0), 1: Load(5, 0)}, key="user-a") == 0
    assert router.choose((4, 4), idle, key="user-a") == 0
    # A flush or restart of its worker sends the key wherever the load says.
    router.forget(0)
    assert router.choose((4, 4), {0: Load(3, 0), 1: Load(0, 0)}, key="user-a") == 1
    assert router.choose((4, 4), idle, key="user-b") == 0  # a new key: least load


# ---------------------------------------------------------------------- supervision


def fake_workers(step_s: float = 0.01) -> Callable[[int, str], list[str]]:
    def command(rank: int, socket: str) -> list[str]:
        return [sys.executable, "-P", "-m", "sluice.bench.synthetic_worker", socket, str(rank),
                str(step_s)]  # fmt: skip

    return command


def with_engine(
    step: Callable[[DataParallelEngine], Awaitable[Any]], *, size: int = 2, step_s: float = 0.01
) -> Any:
    async def go() -> Any:
        engine = DataParallelEngine(fake_workers(step_s), size)
        await engine.start()
        try:
            return await step(engine)
        finally:
            await engine.close()
            # Shutdown stops every worker: none is left running.
            assert all(w.proc is None or w.proc.returncode is not None for w in engine._workers)

    return anyio.run(go)


async def until(condition: Callable[[], bool], seconds: float) -> None:
    """Poll the supervisor's state (it has no event to wait on)."""
    with anyio.fail_after(seconds):
        while True:
            if condition():
                return
            await anyio.sleep(0.05)


class Collect:
    """A request's sink: its batches, and an event set when every choice finished."""

    def __init__(self, choices: int) -> None:
        self.batches: list[list[EngineEvent]] = []
        self.open = choices
        self.done = anyio.Event()

    def __call__(self, events: Any) -> None:
        self.batches.append(list(events))
        self.open -= sum(isinstance(e, SequenceFinished) for e in events)
        if self.open == 0:
            self.done.set()

    @property
    def finishes(self) -> list[SequenceFinished]:
        return [e for b in self.batches for e in b if isinstance(e, SequenceFinished)]


def specs(request_id: str, prompt: tuple[int, ...], n: int, max_tokens: int) -> list[SequenceSpec]:
    sampling = SamplingParams(max_tokens=max_tokens)
    return [SequenceSpec(request_id, i, prompt, sampling) for i in range(n)]


def test_requests_spread_and_a_killed_worker_fails_only_its_own() -> None:
    async def step(engine: DataParallelEngine) -> Any:
        sinks = {}
        for i in range(6):
            sinks[f"r{i}"] = sink = Collect(2)
            engine.submit(specs(f"r{i}", (100 + i,), 2, 400), sink)  # 4 s each: still running
        await anyio.sleep(0.3)
        owners = dict(engine._owner)
        victim = owners["r0"]
        pid = engine._workers[victim].proc.pid  # type: ignore[union-attr]
        os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(10):
            for rid, rank in owners.items():
                if rank == victim:
                    await sinks[rid].done.wait()
        degraded = engine.stats().workers
        for rid, rank in owners.items():
            if rank != victim:
                engine.cancel(rid)
        with anyio.fail_after(10):
            for sink in sinks.values():
                await sink.done.wait()
        await until(lambda: all(w.up for w in engine.stats().workers), 20)
        after = Collect(1)
        engine.submit(specs("again", (1,), 1, 3), after)
        with anyio.fail_after(10):
            await after.done.wait()
        return owners, victim, sinks, degraded, engine.stats().workers, after

    owners, victim, sinks, degraded, recovered, after = with_engine(step)
    assert set(owners.values()) == {0, 1}  # both workers got requests
    for rid, rank in owners.items():
        finishes = sinks[rid].finishes
        assert len(finishes) == 2
        if rank == victim:  # lost: an error each, numbered on from what it had sent
            assert all(f.reason == "abort" and "exited" in (f.error or "") for f in finishes)
            assert all(f.completion_tokens > 0 for f in finishes)
        else:  # cancelled by us, never failed
            assert all(f.reason == "abort" and f.error is None for f in finishes)
    assert [w.up for w in degraded] == [rank != victim for rank in (0, 1)]
    assert all(w.up for w in recovered) and recovered[victim].restarts == 1
    assert [e.reason for e in after.finishes] == ["length"]


def test_a_worker_that_cannot_start_is_a_start_up_error() -> None:
    async def go() -> None:
        engine = DataParallelEngine(lambda rank, socket: [sys.executable, "-c", "exit(3)"], 2)
        await engine.start()

    with pytest.raises(WorkerStartError, match="exited with 3"):
        anyio.run(go)


def test_flush_cache_asks_every_worker_and_forgets_their_prefixes() -> None:
    """Busy on rank 1 only (rank 0's request is cancelled first): the flush must have
    asked rank 1 to be refused. A flush that succeeds forgets what each worker held, so
    the prompt sent before no longer draws its repeat to that worker."""

    async def step(engine: DataParallelEngine) -> Any:
        idle = await engine.flush_cache()
        first, second = Collect(1), Collect(1)
        engine.submit(specs("first", (1, 2, 3, 4), 1, 200), first)  # rank 0 (ties: lowest)
        engine.submit(specs("second", (9, 8, 7, 6), 1, 200), second)  # rank 1 (rank 0 busy)
        engine.cancel("first")
        await first.done.wait()
        await anyio.sleep(0.1)
        busy_elsewhere = await engine.flush_cache()
        engine.cancel("second")
        await second.done.wait()
        await anyio.sleep(0.1)
        before = engine.router.cached_prefix(1, (9, 8, 7, 6))
        flushed = await engine.flush_cache()
        after = engine.router.cached_prefix(1, (9, 8, 7, 6))
        return idle, busy_elsewhere, before, flushed, after

    assert with_engine(step) == (True, False, 4, True, 0)


# ---------------------------------------------------------------------- through HTTP


def test_streams_on_a_killed_worker_end_with_an_error_frame_and_health_says_degraded(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(data_parallel, "BACKOFF_S", (3.0,))  # degraded long enough to see

    async def step(engine: DataParallelEngine) -> Any:
        pipeline = PipelineContext(engine, tokenizer, TokenTexts(tokenizer), engine.max_context)
        client = TestClient(TestServer(create_app(ServerState(pipeline, MODEL))))
        await client.start_server()
        try:
            results: dict[int, bytes] = {}

            async def stream(i: int) -> None:
                prompt = ("Alpha", "Bravo", "Charlie", "Delta")[i]  # no shared prefix
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 300, "stream": True}
                resp = await client.post("/v1/completions", json=body)
                results[i] = await resp.read()

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(stream, i)
                await anyio.sleep(0.5)
                owners = dict(engine._owner)
                victim = engine._workers[0]
                os.kill(victim.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
                await until(lambda: not engine.stats().workers[0].up, 10)
                health = await client.get("/health")
                health_text = await health.text()
                metrics = await (await client.get("/metrics")).text()
                for rid in owners:
                    engine.cancel(rid)
            return owners, results, health.status, health_text, metrics
        finally:
            await client.close()

    owners, results, status, health, metrics = with_engine(step)
    assert (status, health) == (200, "degraded: 1 of 2 engine workers up")
    assert 'sluice_dp_worker_up{dp_rank="0"} 0' in metrics
    assert 'sluice_dp_worker_up{dp_rank="1"} 1' in metrics
    lost = [raw for raw in results.values() if b'"error"' in raw]
    kept = [raw for raw in results.values() if raw.endswith(b"data: [DONE]\n\n")]
    assert len(lost) == list(owners.values()).count(0) > 0
    assert len(kept) == list(owners.values()).count(1) > 0
    for raw in lost:
        last = raw.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
        assert last.startswith(b"data: ")
        assert "engine worker 0 exited" in orjson.loads(last[len(b"data: ") :])["error"]["message"]


def test_a_background_response_on_a_killed_worker_becomes_failed(tokenizer: Any) -> None:
    from sluice.pipeline.chat import ChatSetup

    async def step(engine: DataParallelEngine) -> Any:
        pipeline = PipelineContext(engine, tokenizer, TokenTexts(tokenizer), engine.max_context)
        state = ServerState(pipeline, MODEL, chat=ChatSetup.for_tokenizer(None, tokenizer))
        client = TestClient(TestServer(create_app(state)))
        await client.start_server()
        try:
            body = {"model": MODEL, "input": "Sing", "background": True,
                    "max_output_tokens": 2000}  # fmt: skip
            rid = (await (await client.post("/v1/responses", json=body)).json())["id"]
            await until(lambda: rid in engine._owner, 10)
            worker = engine._workers[engine._owner[rid]]
            os.kill(worker.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
            stored: dict[str, Any] = {}
            with anyio.fail_after(20):
                while stored.get("status") in (None, "queued", "in_progress"):
                    await anyio.sleep(0.05)
                    stored = await (await client.get(f"/v1/responses/{rid}")).json()
            return stored
        finally:
            await client.close()

    stored = with_engine(step)
    assert stored["status"] == "failed"
    assert "exited" in stored["error"]["message"]

"""The front door, readiness and the drain, model-free: ``Admission`` on its own, then
the real app, routes and pipeline over the fake engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from sluice.http.admission import Admission
from sluice.http.app import create_app
from sluice.http.errors import ApiError
from sluice.http.state import Lifecycle, Phase, ServerState
from tests.support.fake_engine import MODEL, FailingEngine, FakeEngine, fake_state

pytestmark = pytest.mark.anyio

LONG = 8000  # max_tokens that outlast every test: such requests end only when dropped


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def completion(max_tokens: int = 2, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Sing", "max_tokens": max_tokens, **extra}


async def until(condition: Callable[[], bool], within_s: float = 120.0) -> None:
    """Wait for ``condition``; the bound only ends a hung test (a loaded CI machine took
    more than 10 s here for twelve streams to open and close)."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


@asynccontextmanager
async def serving(app_of: ServerState | Lifecycle) -> AsyncIterator[TestClient[Any, Any]]:
    # As the CLI runs it: a client that goes away cancels its handler.
    client = TestClient(TestServer(create_app(app_of), handler_cancellation=True))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


def limited(tokenizer: Any, engine: FakeEngine, **limits: Any) -> ServerState:
    state = fake_state(tokenizer, engine)
    state.admission = Admission(**limits)
    return state


@pytest.fixture
def engine(tokenizer: Any) -> FakeEngine:
    return FakeEngine(tokens=tokenizer.encode(" la"), step_s=0.002)


def assert_error(body: dict[str, Any], code: str, type_: str) -> None:
    error = body["error"]
    assert error["code"] == code and error["type"] == type_ and error["message"]


def assert_retry_after(headers: Any) -> None:
    assert int(headers["Retry-After"]) >= 1


# ------------------------------------------------------------------ Admission alone


async def test_fifo_admission_and_an_oversized_request_runs_alone() -> None:
    door = Admission(max_running=2, max_queued=8, queue_timeout=10)
    order: list[str] = []
    release: dict[str, asyncio.Event] = {}

    async def request(name: str, size: int) -> None:
        release[name] = asyncio.Event()
        async with door.slots(size):
            order.append(name)
            await release[name].wait()

    tasks = [asyncio.create_task(request("a", 2))]
    await until(lambda: order == ["a"])
    for queued, (name, size) in enumerate((("big", 5), ("b", 1), ("c", 1)), start=1):
        tasks.append(asyncio.create_task(request(name, size)))
        await until(lambda n=queued: door.queued == n)
    release["a"].set()
    await until(lambda: order == ["a", "big"])  # 5 > 2: alone, and before b and c
    assert door.running == 5 and door.queued == 2
    release["big"].set()
    await until(lambda: order == ["a", "big", "b", "c"])  # both fit now, in order
    release["b"].set()
    release["c"].set()
    await asyncio.gather(*tasks)
    assert door.running == 0 and door.queued == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_unblocks_the_rest() -> None:
    door = Admission(max_running=2, max_queued=8, queue_timeout=10)
    async with door.slots(1):
        head = asyncio.create_task(door.slots(2).__aenter__())
        await until(lambda: door.queued == 1)
        admitted = asyncio.Event()

        async def small() -> None:
            async with door.slots(1):
                admitted.set()

        behind = asyncio.create_task(small())
        await until(lambda: door.queued == 2)
        head.cancel()  # the head (needs 2, 1 free) blocked the small one
        await asyncio.wait_for(admitted.wait(), 5)
        await behind
    assert door.running == 0 and door.queued == 0


async def test_full_queue_is_429_and_a_long_wait_is_503() -> None:
    door = Admission(max_running=1, max_queued=1, queue_timeout=0.5)
    async with door.slots(1):
        waiting = asyncio.create_task(door.slots(1).__aenter__())
        await until(lambda: door.queued == 1)
        with pytest.raises(ApiError) as busy:
            await door.slots(1).__aenter__()
        assert busy.value.status == 429 and busy.value.code == "rate_limit_exceeded"
        with pytest.raises(ApiError) as late:
            await waiting
        assert late.value.status == 503 and late.value.code == "queue_timeout"
        assert door.queued == 0
    assert door.running == 0


# ------------------------------------------------------------------------ over HTTP


async def test_beyond_running_and_queued_capacity_is_429(
    tokenizer: Any, engine: FakeEngine
) -> None:
    state = limited(tokenizer, engine, max_running=1, max_queued=1, queue_timeout=30)
    door = state.admission
    async with serving(state) as client:
        running = asyncio.create_task(client.post("/v1/completions", json=completion(LONG)))
        await until(lambda: door.running == 1)
        queued = asyncio.create_task(client.post("/v1/completions", json=completion(LONG)))
        await until(lambda: door.queued == 1)
        resp = await client.post("/v1/completions", json=completion())
        assert resp.status == 429
        assert_retry_after(resp.headers)
        assert_error(await resp.json(), "rate_limit_exceeded", "rate_limit_error")
        # n × prompts count: two choices of one request cannot even queue now.
        resp = await client.post("/v1/completions", json=completion(n=2))
        assert resp.status == 429
        for task in (running, queued):
            task.cancel()
        await until(lambda: door.running == 0 and door.queued == 0 and not engine.running)


async def test_a_request_queued_too_long_is_503(tokenizer: Any, engine: FakeEngine) -> None:
    state = limited(tokenizer, engine, max_running=1, max_queued=4, queue_timeout=0.2)
    async with serving(state) as client:
        running = asyncio.create_task(client.post("/v1/completions", json=completion(LONG)))
        await until(lambda: state.admission.running == 1)
        started = time.monotonic()
        resp = await client.post("/v1/completions", json=completion(stream=True))
        assert resp.status == 503 and time.monotonic() - started >= 0.2
        assert_retry_after(resp.headers)
        assert_error(await resp.json(), "queue_timeout", "server_error")
        assert state.admission.queued == 0
        running.cancel()
        await until(lambda: state.admission.running == 0)


async def test_queued_requests_are_served_in_arrival_order(
    tokenizer: Any, engine: FakeEngine
) -> None:
    state = limited(tokenizer, engine, max_running=1, max_queued=8, queue_timeout=30)
    order: list[int] = []

    async with serving(state) as client:

        async def request(index: int, max_tokens: int) -> None:
            resp = await client.post("/v1/completions", json=completion(max_tokens))
            assert resp.status == 200
            await resp.read()
            order.append(index)

        tasks = [asyncio.create_task(request(0, 30))]
        await until(lambda: state.admission.running == 1)
        for index in range(1, 6):
            tasks.append(asyncio.create_task(request(index, 1)))
            await until(lambda i=index: state.admission.queued == i)
        await asyncio.gather(*tasks)
    assert order == list(range(6))


async def test_slots_are_released_after_completion_and_errors(
    tokenizer: Any, engine: FakeEngine
) -> None:
    failing = FailingEngine(tokens=engine.tokens)
    for backend in (engine, failing):
        state = limited(tokenizer, backend, max_running=4, max_queued=4, queue_timeout=5)
        ok = backend is engine
        async with serving(state) as client:
            resp = await client.post("/v1/completions", json=completion(3, n=2))
            assert resp.status == (200 if ok else 500)
            resp = await client.post("/v1/completions", json=completion(3, stream=True))
            body = await resp.read()
            assert body.endswith(b"data: [DONE]\n\n") if ok else b'"boom"' in body
            assert state.admission.running == 0 and state.admission.queued == 0


async def test_dropped_streams_release_their_slots_at_once(
    tokenizer: Any, engine: FakeEngine
) -> None:
    state = limited(tokenizer, engine, max_running=4, max_queued=16, queue_timeout=30)
    door = state.admission
    async with serving(state) as client:
        opened = [
            asyncio.create_task(client.post("/v1/completions", json=completion(LONG, stream=True)))
            for _ in range(12)
        ]
        await until(lambda: door.queued == 8 and sum(t.done() for t in opened) == 4)
        streams = [task.result() for task in opened if task.done()]
        assert len(streams) == 4
        for resp in streams:
            await resp.content.readuntil(b"\n\n")  # tokens are flowing
            resp.close()
        for task in opened:
            task.cancel()
        await until(lambda: door.running == 0 and door.queued == 0 and not engine.running)
        metrics = await (await client.get("/metrics")).text()
        assert "\nsluice_queued_requests 0\n" in metrics
        assert "\nsluice_running_sequences 0\n" in metrics
        started = time.monotonic()
        resp = await client.post("/v1/completions", json=completion(2))
        assert resp.status == 200 and time.monotonic() - started < 1.0


# ------------------------------------------------------------------ readiness, drain


async def test_everything_but_metrics_is_503_until_the_model_is_loaded(
    tokenizer: Any, engine: FakeEngine
) -> None:
    lifecycle = Lifecycle()
    async with serving(lifecycle) as client:
        for method, path in (
            ("GET", "/health"),
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
        ):
            resp = await client.request(method, path, json=completion())
            assert resp.status == 503, path
            assert_retry_after(resp.headers)
            assert_error(await resp.json(), "model_loading", "server_error")
        assert (await client.get("/metrics")).status == 200
        lifecycle.ready(fake_state(tokenizer, engine))
        assert (await client.get("/health")).status == 200
        assert (await client.post("/v1/completions", json=completion())).status == 200


async def test_drain_finishes_short_requests_and_ends_the_rest(
    tokenizer: Any, engine: FakeEngine
) -> None:
    state = limited(tokenizer, engine, max_running=2, max_queued=4, queue_timeout=30)
    lifecycle = Lifecycle.serving(state)
    async with serving(lifecycle) as client:
        short = await client.post("/v1/completions", json=completion(100, stream=True))
        long = await client.post("/v1/completions", json=completion(LONG, stream=True))
        unary = asyncio.create_task(client.post("/v1/completions", json=completion(LONG)))
        await until(lambda: state.admission.queued == 1)

        drained = asyncio.create_task(lifecycle.drain(2.0))
        await until(lambda: lifecycle.phase is Phase.DRAINING)
        refused = await client.post("/v1/completions", json=completion())
        assert refused.status == 503
        assert_error(await refused.json(), "shutting_down", "server_error")

        assert (await short.read()).endswith(b"data: [DONE]\n\n")  # within the grace
        frames = (await long.read()).split(b"\n\n")
        last = orjson.loads(frames[-2].removeprefix(b"data: "))
        assert last["error"]["message"] == "the server is shutting down"
        assert last["error"]["code"] == "shutting_down"
        resp = await unary  # admitted once ``short`` ended, or still queued: 503 either way
        assert resp.status == 503
        assert_error(await resp.json(), "shutting_down", "server_error")
        await drained
        assert state.admission.running == 0 and not engine.running

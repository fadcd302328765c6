"""Under load, against the real server: 256 concurrent streams all complete (the
front door queues them fairly), and many dropped clients — streaming and unary —
leave no sequence running."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import Server

pytestmark = pytest.mark.model

STREAMS = 256


def metric(server: Server, name: str) -> float:
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing from /metrics")


async def stream_one(
    session: aiohttp.ClientSession, server: Server, i: int
) -> tuple[float, str | None, int]:
    """(TTFT in seconds, finish reason, content chunks) of one streamed completion."""
    body = {
        "model": server.model,
        "prompt": f"Request {i}: count to three.",
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    ttft = -1.0
    finish = None
    chunks = 0
    async with session.post(f"{server.v1}/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                if choice["text"] and ttft < 0:
                    ttft = time.perf_counter() - start
                chunks += 1
                finish = choice["finish_reason"] or finish
    return ttft, finish, chunks


def test_256_concurrent_streams_all_complete(server: Server, tmp_path: Path) -> None:
    async def run() -> list[tuple[float, str | None, int]]:
        connector = aiohttp.TCPConnector(limit=STREAMS + 8)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            return await asyncio.gather(*(stream_one(session, server, i) for i in range(STREAMS)))

    results = asyncio.run(run())
    assert len(results) == STREAMS
    assert all(finish == "length" for _, finish, _ in results)
    ttfts = sorted(t for t, _, _ in results)
    assert ttfts[0] > 0  # every stream produced text
    spread = {
        "streams": STREAMS,
        "ttft_min_s": ttfts[0],
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p99_s": ttfts[int(len(ttfts) * 0.99) - 1],
        "ttft_max_s": ttfts[-1],
    }
    # Reported, never asserted (timings on shared machines are noise): see
    # docs/operations.md for a measured spread.
    print("TTFT spread:", json.dumps(spread))
    (tmp_path / "ttft_spread.json").write_text(json.dumps(spread))
    assert metric(server, "sluice_queued_requests") == 0
    assert metric(server, "sluice_admitted_sequences") == 0


def test_dropped_clients_leave_nothing_running(server: Server) -> None:
    """Eight streams (n=2) and four unary requests (n=2) are abandoned mid-generation;
    every one of their sequences leaves the engine and new requests are served."""

    async def abandon_stream(session: aiohttp.ClientSession) -> None:
        body = {
            "model": server.model,
            "prompt": "Tell me a long story.",
            "max_tokens": 2000,
            "n": 2,
            "ignore_eos": True,
            "stream": True,
        }
        async with session.post(f"{server.v1}/completions", json=body) as response:
            assert response.status == 200
            seen = 0
            async for raw in response.content:
                if raw.startswith(b"data: "):
                    seen += 1
                    if seen == 3:
                        return  # leaving the block closes the connection

    async def abandon_unary(session: aiohttp.ClientSession) -> None:
        body = {
            "model": server.model,
            "prompt": "Tell me a long story.",
            "max_tokens": 2000,
            "n": 2,
            "ignore_eos": True,
        }
        try:
            await session.post(
                f"{server.v1}/completions", json=body, timeout=aiohttp.ClientTimeout(total=3)
            )
        except TimeoutError:
            return
        raise AssertionError("a 2000-token unary request answered within 3 s")

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(
                *(abandon_stream(session) for _ in range(8)),
                *(abandon_unary(session) for _ in range(4)),
            )

    asyncio.run(run())
    deadline = time.monotonic() + 60
    while metric(server, "sluice_running_sequences") != 0:
        assert time.monotonic() < deadline, "abandoned sequences are still running"
        time.sleep(0.1)
    assert metric(server, "sluice_admitted_sequences") == 0

    body: dict[str, Any] = {"model": server.model, "prompt": "Hi", "max_tokens": 1}
    request = urllib.request.Request(
        f"{server.v1}/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert json.loads(response.read())["usage"]["completion_tokens"] == 1

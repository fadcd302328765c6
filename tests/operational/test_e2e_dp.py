"""``--dp-size 2`` with the real default model: one front end over two engine worker
processes. Greedy outputs equal the shared ``--dp-size 1`` server's; 64 concurrent
streams complete; a worker killed with SIGKILL fails only its own streams (each ends
with an error frame), ``/health`` says degraded, and the front end starts it again.

Starts its own server (two workers, one thread each); the shared one idles meanwhile.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from sluice.engine.assembly import UNQUANTISED
from tests.conftest import DEFAULT_GGUF, MODEL_NAME, Server, launch_server, missing_model
from tests.support.plain_http import get, sse_data

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "Water boils at"]  # fmt: skip


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if not DEFAULT_GGUF.exists():
        missing_model(f"default model missing at {DEFAULT_GGUF}: run `make model`")
    workdir = tmp_path_factory.mktemp("dp")
    with launch_server(
        DEFAULT_GGUF, workdir, MODEL_NAME, "--dp-size", "2", "--threads", "1"
    ) as running:
        yield running


def worker_pids(server: Server) -> list[int]:
    """The front end's child processes: its engine workers."""
    assert server.pid is not None
    children = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
    return [int(pid) for pid in children]


def complete(client: openai.OpenAI, prompt: str) -> str:
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
    return out.choices[0].text


def test_greedy_outputs_equal_one_engine(dp_server: Server, client: openai.OpenAI) -> None:
    with openai.OpenAI(base_url=dp_server.v1, api_key="unused", max_retries=0) as dp:
        for prompt in PROMPTS:
            assert complete(dp, prompt) == complete(client, prompt)
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 12, "temperature": 0}  # fmt: skip
        assert (dp.chat.completions.create(**chat).choices[0].message.content
                == client.chat.completions.create(**chat).choices[0].message.content)  # fmt: skip
    info = get(f"{dp_server.base_url}/server_info").json()
    assert info["dp_size"] == 2 and [s["dp_rank"] for s in info["internal_states"]] == [0, 1]
    # Decided in a worker, where the model is: its hello carries it to the front end.
    assert info["decode_path"] == {"path": "transformers", "reason": UNQUANTISED}
    assert get(f"{dp_server.base_url}/health").text == "ok"


def test_64_concurrent_streams_complete_on_both_workers(dp_server: Server) -> None:
    def one(i: int) -> str:
        with openai.OpenAI(base_url=dp_server.v1, api_key="unused", max_retries=0) as dp:
            stream = dp.completions.create(model=MODEL_NAME, prompt=f"{i} little pigs",
                                           max_tokens=8, stream=True, temperature=0)  # fmt: skip
            return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

    busy: set[str] = set()  # the ranks seen running sequences while the burst ran
    finished = threading.Event()

    def watch() -> None:
        while not finished.is_set():
            for line in get(f"{dp_server.base_url}/metrics").text.splitlines():
                if line.startswith("sluice_dp_running_sequences{") and not line.endswith(" 0"):
                    busy.add(line.split('"')[1])
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(64) as pool:
            texts = list(pool.map(one, range(64)))
    finally:
        finished.set()
        watcher.join()
    assert all(texts)
    assert busy == {"0", "1"}, busy  # both workers served
    metrics = get(f"{dp_server.base_url}/metrics").text
    for rank in (0, 1):
        assert f'sluice_dp_worker_up{{dp_rank="{rank}"}} 1' in metrics


def routed(server: Server) -> dict[int, int]:
    """Sequences the front end has sent each worker (``/metrics``)."""
    counts = {}
    for line in get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith("sluice_dp_routed_sequences_total{"):
            counts[int(line.split('"')[1])] = int(line.rsplit(" ", 1)[1])
    return counts


def since(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    return {rank: after[rank] - before.get(rank, 0) for rank in after}


SYSTEM = (  # ≈80 words, as a chat application sends with every request
    "You are a helpful assistant for a small bookshop. Answer in one short sentence. "
    "Be polite and concrete, never invent titles or prices, and when you are unsure say "
    "so. The shop opens at nine and closes at six, sells new and second-hand books, "
    "orders any book in print within three days, and runs a reading group on the first "
    "Monday of each month. Customers may reserve books by phone or in person."
)


def test_a_burst_sharing_a_system_prompt_runs_on_both_workers(dp_server: Server) -> None:
    """Prefix affinity alone sent all 16 to one worker; past the balance threshold the
    burst spreads, the larger share at most twice the smaller."""

    def ask(i: int) -> str:
        with openai.OpenAI(base_url=dp_server.v1, api_key="unused", max_retries=0) as dp:
            out = dp.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": f"Question {i}: do you sell maps?"}],
                max_tokens=8, temperature=0,
            )  # fmt: skip
            return out.choices[0].message.content or ""

    before = routed(dp_server)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    spread = since(before, routed(dp_server))
    assert all(answers) and sum(spread.values()) == 16
    assert min(spread.values()) > 0 and max(spread.values()) <= 2 * min(spread.values()), spread
    loads = get(f"{dp_server.base_url}/v1/loads").json()["loads"]
    rates = [load["cache_hit_rate"] for load in loads]
    assert len(rates) == 2 and all(0 < rate < 1 for rate in rates), rates  # each its own


def test_one_prompt_cache_key_stays_on_one_worker(dp_server: Server) -> None:
    """A keyed request finds rank 0 busy and goes to rank 1; later ones with the key
    follow it there though both are idle (where a tie would pick rank 0), whatever
    their prompts."""
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 300, "ignore_eos": True,
                            "stream": True, "prompt": "Zulu yankee xray"}  # fmt: skip
    started = threading.Event()

    def occupy() -> None:
        for _ in sse_data(f"{dp_server.v1}/completions", body):
            started.set()

    before = routed(dp_server)
    long_run = threading.Thread(target=occupy)
    long_run.start()
    started.wait(120)
    busy_rank = next(rank for rank, n in since(before, routed(dp_server)).items() if n)
    with openai.OpenAI(base_url=dp_server.v1, api_key="unused", max_retries=0) as dp:

        def keyed(prompt: str) -> None:
            key = {"prompt_cache_key": "shop-7"}
            dp.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4,
                                  temperature=0, extra_body=key)  # fmt: skip

        before = routed(dp_server)
        keyed("Violet skies over")  # prompts no worker has seen, none a prefix of another
        first = since(before, routed(dp_server))
        long_run.join(300)
        for prompt in ("Copper kettles", "Nine wolves ran", "Quiet harbours at"):
            keyed(prompt)
    home = next(rank for rank, n in first.items() if n)
    assert home != busy_rank
    assert since(before, routed(dp_server)) == {home: 4, busy_rank: 0}


def test_a_killed_worker_fails_only_its_streams_and_comes_back(dp_server: Server) -> None:
    results: dict[int, list[str]] = {}
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 400, "stream": True,
                            "ignore_eos": True}  # fmt: skip
    openers = ["Alpha", "Bravo", "Charlie", "Delta"]  # no shared prefix: spread by load

    def stream(i: int) -> None:
        results[i] = list(sse_data(f"{dp_server.v1}/completions", {**body, "prompt": openers[i]}))

    readers = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for reader in readers:
        reader.start()
    time.sleep(3)  # every stream is generating
    victim = worker_pids(dp_server)[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while get(f"{dp_server.base_url}/health").text == "ok":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    degraded = get(f"{dp_server.base_url}/health").text
    for reader in readers:
        reader.join(300)
    lost = [r for r in results.values() if r[-1] != "[DONE]"]
    kept = [r for r in results.values() if r[-1] == "[DONE]"]
    assert degraded == "degraded: 1 of 2 engine workers up"
    assert lost and kept  # the two workers each had some
    for frames in lost:
        assert "exited" in json.loads(frames[-1])["error"]["message"]
    deadline = time.monotonic() + 120
    while get(f"{dp_server.base_url}/health").text != "ok":  # restarted and loaded again
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert victim not in worker_pids(dp_server)
    with openai.OpenAI(base_url=dp_server.v1, api_key="unused", max_retries=0) as dp:
        assert complete(dp, PROMPTS[0])

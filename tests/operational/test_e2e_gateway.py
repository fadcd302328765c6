"""Sluice servers as workers behind SGLang's model gateway (SMG, the pinned ``smg``
wheel), end to end: two Sluice servers with the real default model share one
PostgreSQL Responses store; ``smg launch --policy cache_aware`` in front of them, on
loopback. Through the gateway, with the official ``openai`` SDK: chat, completions,
Responses (a response created on one worker continues on the other) and SGLang's
``/generate``; both workers serve; after one worker is killed, requests keep
succeeding through the gateway.

Starts its own two servers (one thread each) and the gateway; the shared session
server idles meanwhile.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import (
    DEFAULT_GGUF,
    MODEL_NAME,
    Server,
    free_port,
    launch_server,
    missing,
    missing_model,
)
from tests.support.plain_http import get, post
from tests.support.responses_spec import check_response

pytestmark = pytest.mark.model

ROUTED = "x-smg-routed-worker-id"  # the gateway names the worker that answered


def smg_binary() -> str | None:
    """The ``smg`` script of this environment (pip installs it beside the interpreter)."""
    beside = Path(sys.executable).with_name("smg")
    return str(beside) if beside.exists() else shutil.which("smg")


def smg_has_a_wheel() -> bool:
    """The platforms of smg 1.13.0's wheels (pyproject's marker says the same)."""
    machine = platform.machine().lower()
    return (
        (sys.platform == "linux" and machine == "x86_64")
        or (sys.platform == "darwin" and machine == "arm64")
        or sys.platform == "win32"
    )


def _ready(url: str, workers: int) -> bool:
    try:
        reply = get(f"{url}/readiness", timeout=2)
    except OSError:
        return False
    return reply.status == 200 and reply.json().get("healthy_workers") == workers


class Cluster:
    def __init__(self, gateway: str, workers: list[Server], procs: dict[str, int]) -> None:
        self.gateway = gateway
        self.workers = workers
        self.pids = procs


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, postgres_module_db: str) -> Iterator[Cluster]:
    if not DEFAULT_GGUF.exists():
        missing_model(f"default model missing at {DEFAULT_GGUF}: run `make model`")
    smg = smg_binary()
    if smg is None and not smg_has_a_wheel():
        pytest.skip(f"PyPI has no smg wheel for {sys.platform}/{platform.machine()}")
    if smg is None:
        missing("smg is not installed", "installs it (.[dev])")
    with ExitStack() as stack:
        workers = [
            stack.enter_context(
                launch_server(
                    DEFAULT_GGUF,
                    tmp_path_factory.mktemp(f"worker{i}"),
                    MODEL_NAME,
                    "--threads",
                    "1",
                    "--responses-db",
                    postgres_module_db,
                    "--responses-owner",
                    f"worker{i}",
                )
            )
            for i in range(2)
        ]
        port, log = free_port(), tmp_path_factory.mktemp("gateway") / "smg.log"
        cmd = [
            smg,
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *(w.base_url for w in workers),
            "--policy",
            "cache_aware",
            "--prometheus-port",
            str(free_port()),
            "--health-check-interval-secs",
            "1",
            "--health-failure-threshold",
            "1",
            "--worker-startup-check-interval",
            "1",
        ]
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        stack.callback(_stop, proc)
        gateway = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not _ready(gateway, 2):
            assert proc.poll() is None, f"smg exited:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"smg never ready:\n{log.read_text()[-4000:]}"
            time.sleep(0.3)
        print("gateway:", " ".join(cmd))
        yield Cluster(gateway, workers, {w.base_url: w.pid or 0 for w in workers})


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def postgres_module_db(postgres: str) -> str:
    """One database that both workers share for the module."""
    import asyncio

    import asyncpg

    async def create() -> None:
        conn = await asyncpg.connect(postgres)
        try:
            await conn.execute("CREATE DATABASE gateway_responses")
        finally:
            await conn.close()

    asyncio.run(create())
    return postgres.rsplit("/", 1)[0] + "/gateway_responses"


def sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def test_both_workers_serve_the_openai_routes_through_the_gateway(cluster: Cluster) -> None:
    direct = sdk(cluster.workers[0].base_url)
    through = sdk(cluster.gateway)
    served: set[str] = set()
    prompts = [
        "The capital of France is",
        "Write a haiku about rivers.",
        "def fibonacci(n):",
        "Zebras live in",
        "1, 2, 3, 4,",
        "Qatar is a",
    ]
    for prompt in prompts:
        raw = through.completions.with_raw_response.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0
        )
        served.add(raw.headers[ROUTED])
        expected = direct.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0
        )
        assert raw.parse().choices[0].text == expected.choices[0].text
    chat = through.chat.completions.with_raw_response.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=8,
        temperature=0,
    )
    served.add(chat.headers[ROUTED])
    alone = direct.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=8,
        temperature=0,
    )
    assert chat.parse().choices[0].message.content == alone.choices[0].message.content
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in through.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        if chunk.choices
    )
    assert streamed == alone.choices[0].message.content
    assert served == {w.base_url for w in cluster.workers}


def test_a_response_continues_on_another_worker(cluster: Cluster) -> None:
    """The store is shared: a response created on one worker is found, listed and
    continued on the other, and continued through the gateway wherever it routes."""
    first, second = (sdk(w.base_url) for w in cluster.workers)
    created = first.responses.create(
        model=MODEL_NAME,
        input="What is the capital of France?",
        max_output_tokens=16,
        temperature=0,
    )
    assert second.responses.retrieve(created.id).output_text == created.output_text
    items = second.responses.input_items.list(created.id)
    assert [item.type for item in items.data] == ["message"]
    follow = second.responses.create(
        model=MODEL_NAME,
        input="And of Italy?",
        previous_response_id=created.id,
        max_output_tokens=16,
        temperature=0,
    )
    check_response(follow.model_dump(mode="json", exclude_unset=True))
    assert follow.usage is not None and created.usage is not None
    assert follow.usage.input_tokens > created.usage.input_tokens + created.usage.output_tokens
    ask: dict[str, Any] = {
        "model": MODEL_NAME,
        "input": "And of Spain?",
        "temperature": 0,
        "previous_response_id": follow.id,
        "max_output_tokens": 16,
    }
    through = sdk(cluster.gateway).responses.create(**ask)
    assert through.previous_response_id == follow.id
    assert through.output_text == first.responses.create(**ask).output_text
    for worker in (first, second):  # stored where every worker sees it
        assert worker.responses.retrieve(through.id).output_text == through.output_text


def test_generate_through_the_gateway(cluster: Cluster) -> None:
    body = {
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 6, "temperature": 0},
    }
    through = post(f"{cluster.gateway}/generate", body)
    direct = post(f"{cluster.workers[1].base_url}/generate", body)
    assert through.status == 200, through.text
    assert through.json()["text"] == direct.json()["text"]
    assert through.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_requests_keep_succeeding_after_a_worker_is_killed(cluster: Cluster) -> None:
    import os
    import signal

    victim = cluster.workers[0].base_url
    os.kill(cluster.pids[victim], signal.SIGKILL)
    through = sdk(cluster.gateway)
    served = set()
    for i in range(8):
        raw = through.completions.with_raw_response.create(
            model=MODEL_NAME, prompt=f"Count to {i}:", max_tokens=4, temperature=0
        )
        assert raw.parse().choices[0].text
        served.add(raw.headers[ROUTED])
    assert served == {cluster.workers[1].base_url}
    reply = through.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert reply.choices[0].message.content is not None

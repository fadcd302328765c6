"""Shared fixtures. One model server per test session: two engines at once crawl on
two cores, so every end-to-end test talks to the same process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

REPO = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("SLUICE_MODELS_DIR", REPO / "models"))
DEFAULT_GGUF = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
# The second real model (``make model-gemma``): sliding-window attention, BOS, no template.
GEMMA_GGUF = MODELS / "gemma-3-270m-q4_k_m.gguf"
GEMMA_NAME = "gemma-3-270m"


def missing_model(reason: str) -> NoReturn:
    """Skip a model-backed test where the model was never fetched (``make unit`` on a
    fresh checkout); under CI, where ``make test`` fetched it, that is a failure."""
    missing(reason, "fetches the model first")


def missing(reason: str, what_make_test_does: str) -> NoReturn:
    """Skip where a checkout lacks what ``make test`` would have set up; fail under CI."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI runs `make test`, which {what_make_test_does})")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Server:
    base_url: str
    record_dir: Path
    model: str = MODEL_NAME
    pid: int | None = None  # the server process, e.g. to read its memory from /proc
    log: Path | None = None  # what the server wrote (stdout and stderr)

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"server did not become healthy:\n{log.read_text()[-4000:]}")


@contextmanager
def spawn_server(
    model_path: Path,
    workdir: Path,
    model_name: str,
    *extra: str,
    env: dict[str, str] | None = None,
    quantization: str | None = "none",
) -> Iterator[tuple[Server, subprocess.Popen[bytes], Path]]:
    """A real ``python -P -m sluice`` on a free port, started but not yet waited for
    (the server, its process and its log); stopped at the end. ``quantization``: the
    method unless ``extra`` names one; ``none`` (the de-quantised weights, whose greedy
    outputs the tests expect) by default, None for the server's own default."""
    if quantization is not None and "--quantization" not in extra:
        extra = ("--quantization", quantization, *extra)
    port = free_port()
    record_dir = workdir / "recordings"
    log = workdir / "server.log"
    cmd = [
        sys.executable, "-P", "-m", "sluice",
        "--model-path", str(model_path),
        "--dtype", "float32",  # the greedy outputs the tests expect
        "--port", str(port),
        "--record-dir", str(record_dir),
        "--responses-db", str(workdir / "responses.sqlite3"),
        "--log-format", "json",
        *extra,
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **(env or {})}
        )
    try:
        yield (
            Server(f"http://127.0.0.1:{port}", record_dir, model=model_name, pid=proc.pid, log=log),
            proc,
            log,
        )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_healthy(server: Server, proc: subprocess.Popen[bytes], log: Path) -> None:
    _wait_healthy(server.base_url, proc, log, timeout=300)


@contextmanager
def launch_server(
    model_path: Path, workdir: Path, model_name: str, *extra: str, quantization: str | None = "none"
) -> Iterator[Server]:
    """A real ``python -P -m sluice`` on a free port, healthy; stopped at the end
    (``quantization`` as ``spawn_server`` takes it)."""
    with spawn_server(model_path, workdir, model_name, *extra, quantization=quantization) as (
        server,
        proc,
        log,
    ):
        wait_healthy(server, proc, log)
        yield server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The real server with the real default model, started once per session."""
    if not DEFAULT_GGUF.exists():
        missing_model(f"default model missing at {DEFAULT_GGUF}: run `make model`")
    with launch_server(DEFAULT_GGUF, tmp_path_factory.mktemp("server"), MODEL_NAME) as running:
        yield running


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """A converted model folder (tokenizer.json, chat template) from the models cache."""
    found = sorted((MODELS / "cache").glob("*/tokenizer.json"))
    if not found:
        missing_model("no converted model under models/cache: run `make model`")
    return found[0].parent


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    """The default model's tokenizer (SmolLM2, byte-level BPE), loaded once."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="session")
def client(server: Server) -> Iterator[Any]:
    """The official ``openai`` SDK against the shared server (no retries: a failure
    shows at once)."""
    import openai

    with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="session")
def model(server: Server) -> str:
    return server.model


@pytest.fixture(scope="session")
def postgres() -> Iterator[str]:
    """A throwaway PostgreSQL server for the session; its DSN."""
    from tests.support.postgres_server import binaries, running_postgres

    if binaries() is None:
        missing("PostgreSQL is not installed", "installs it (`make postgres`)")
    with running_postgres(free_port()) as dsn:
        yield dsn


@pytest.fixture
def postgres_db(postgres: str) -> str:
    """A new, empty database on the session's server, for one test; its DSN."""
    import asyncio
    import uuid

    import asyncpg

    name = f"t_{uuid.uuid4().hex[:12]}"

    async def create() -> None:
        conn = await asyncpg.connect(postgres)
        try:
            await conn.execute(f"CREATE DATABASE {name}")
        finally:
            await conn.close()

    asyncio.run(create())
    return postgres.rsplit("/", 1)[0] + f"/{name}"


StoreOpener = Callable[..., Awaitable[Any]]


@pytest.fixture(params=["sqlite", "postgres"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreOpener:
    """Opens a ``ResponseStore`` on one database, fresh for the test: SQLite in a file,
    or PostgreSQL on the session's server. Each call is a new store instance (a new
    process, or another front end) on the same data; ``owner`` names the front end
    (PostgreSQL only: SQLite is one front end's)."""
    from sluice.http.store import PostgresResponseStore, SqliteResponseStore

    if request.param == "sqlite":
        path = tmp_path / "responses.sqlite3"

        async def sqlite(owner: str = "a") -> Any:
            return SqliteResponseStore(path)

        return sqlite
    dsn = request.getfixturevalue("postgres_db")

    async def postgres(owner: str = "a") -> Any:
        return await PostgresResponseStore.connect(dsn, owner=owner)

    return postgres

"""Slow and idle clients cannot lock fast ones out: connections are capped below the
open-file limit, at the cap the connection that has waited longest for its request
makes room, a request head has a deadline, and refusals are clean 503s with OpenAI's
envelope. Model-free: the real app over the fake engine in a process under a 1 024
open-file limit, and small apps in-process for each rule."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import resource
import select
import socket
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import structlog
import trustme
from aiohttp import web

from sluice.cli import build_parser
from sluice.http.connections import (
    ACCEPT_ERROR,
    ConnectionLimits,
    Connections,
    GuardedSite,
    default_max_connections,
    log_accept_errors,
    raise_open_file_limit,
)
from tests.conftest import REPO, missing
from tests.support.fake_engine import MODEL

SLOW_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
SLOW = 1200
OPEN_FILES = 1024


@contextmanager
def open_files_at_least(n: int) -> Iterator[None]:
    """This process's soft open-file limit raised to ``n`` for the block."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < n:
        missing(
            f"the open-file hard limit ({hard}) is under {n}",
            "runs as root, whose hard limit is far above it",
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, n), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextmanager
def bounded_server(tokenizer_dir: Path, log: Path, *args: str) -> Iterator[int]:
    """``tests/support/bounded_server.py`` in its own process; its port. Its stderr
    (the log) goes to ``log``."""
    launch = (
        "import sys; sys.path.append(sys.argv[1]);"
        "from tests.support.bounded_server import main; sys.exit(main(sys.argv[2:]))"
    )
    cmd = [sys.executable, "-P", "-c", launch, str(REPO), "--tokenizer-dir", str(tokenizer_dir)]
    with log.open("wb") as err:
        proc = subprocess.Popen([*cmd, *args], stdout=subprocess.PIPE, stderr=err, cwd=REPO)
    assert proc.stdout is not None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 180)
        line = proc.stdout.readline().decode() if ready else ""
        if not line.startswith("port "):
            proc.kill()
            proc.wait()
            pytest.fail(f"the server did not start ({proc.returncode}):\n{log.read_text()}")
        yield int(line.split()[1])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def call(port: int, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.status, json.loads(resp.read())


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock``: at EOF, with nothing sent first. A reset
    fails the test: a closed connection must end cleanly."""
    sock.setblocking(False)
    try:
        data = sock.recv(1024)
    except BlockingIOError:
        return False
    assert data == b"", data
    return True


def test_a_normal_client_is_served_while_1200_slow_connections_are_open(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    slow: list[socket.socket] = []
    with (
        open_files_at_least(SLOW + 256),
        bounded_server(tokenizer_dir, log, "--open-files", str(OPEN_FILES)) as port,
    ):
        try:
            for _ in range(SLOW):
                sock = socket.create_connection(("127.0.0.1", port), timeout=30)
                sock.sendall(SLOW_HEAD)
                slow.append(sock)
            status, models = call(port, "/v1/models")
            assert status == 200 and models["data"][0]["id"] == MODEL
            completion = {"model": MODEL, "prompt": "Sing", "max_tokens": 3}
            status, body = call(port, "/v1/completions", completion)
            assert status == 200 and body["choices"][0]["text"] == " la la la"
            closed = sum(closed_by_server(sock) for sock in slow)
        finally:
            for sock in slow:
                sock.close()
    cap = default_max_connections(OPEN_FILES)
    assert closed >= SLOW - cap  # the oldest made room, each with a clean close
    text = log.read_text()
    assert text.count("Traceback") == 0, text[-4000:]
    events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    [limits] = [e for e in events if e["event"] == "connection limits"]
    assert limits["open_files"] == OPEN_FILES and limits["max_connections"] == cap
    shed = [e for e in events if e["event"] == "connections closed by the limits"]
    assert shed and shed[0]["evicted"] >= 1 and shed[0]["level"] == "warning"


# In-process rules, on a small app.

WAIT = web.AppKey("wait", asyncio.Event)
WAITING = web.AppKey("waiting", list[web.Request])


def small_app(handler_args: dict[str, Any] | None = None) -> web.Application:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def wait(request: web.Request) -> web.Response:
        request.app[WAITING].append(request)
        await request.app[WAIT].wait()
        return web.Response(text="waited")

    async def echo(request: web.Request) -> web.Response:
        return web.Response(text=str(len(await request.read())))

    app = web.Application(handler_args=handler_args)
    app[WAIT] = asyncio.Event()
    app[WAITING] = []
    app.router.add_get("/ok", ok)
    app.router.add_get("/wait", wait)
    app.router.add_post("/echo", echo)
    return app


@asynccontextmanager
async def guarded(
    app: web.Application, limits: ConnectionLimits, ssl_context: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[int, Connections]]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    assert runner.server is not None
    connections = Connections(runner.server, limits)
    await GuardedSite(runner, connections, "127.0.0.1", 0, ssl_context=ssl_context).start()
    try:
        yield runner.addresses[0][1], connections
    finally:
        await runner.cleanup()


Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def until(condition: Callable[[], bool]) -> None:
    """Until the server, on this loop, has done what ``condition`` checks."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    pytest.fail("the server never got there")


async def connect(port: int, ssl_context: ssl.SSLContext | None = None) -> Stream:
    return await asyncio.open_connection("127.0.0.1", port, ssl=ssl_context)


async def response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status_line, *lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines if line)
    body = await asyncio.wait_for(reader.readexactly(int(headers["Content-Length"])), 10)
    return int(status_line.split()[1]), headers, body


async def get(stream: Stream, path: str) -> tuple[int, dict[str, str], bytes]:
    stream[1].write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return await response(stream[0])


async def closed(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection within a generous bound, sending
    nothing more."""
    try:
        return await asyncio.wait_for(reader.read(), 10) == b""
    except TimeoutError:
        return False


async def still_open(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        await asyncio.wait_for(reader.read(1), seconds)
    except TimeoutError:
        return True
    return False


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # aiohttp runs on asyncio only


@pytest.mark.anyio
async def test_a_head_that_never_completes_is_closed_after_the_header_timeout() -> None:
    async with guarded(small_app(), ConnectionLimits(100, header_timeout=0.5)) as (port, conns):
        partial = await connect(port)
        partial[1].write(SLOW_HEAD)
        silent = await connect(port)  # connected, never a byte
        assert await closed(partial[0]) and await closed(silent[0])
        status, _, body = await get(await connect(port), "/ok")
        assert (status, body, conns.open) == (200, b"ok", 1)


@pytest.mark.anyio
async def test_a_kept_alive_connections_deadline_starts_with_its_next_request() -> None:
    async with guarded(small_app(), ConnectionLimits(100, header_timeout=0.5)) as (port, _):
        stream = await connect(port)
        assert (await get(stream, "/ok"))[0] == 200
        # Idle between requests: keep-alive's business, not the header deadline's.
        assert await still_open(stream[0], 1.5)
        assert (await get(stream, "/ok"))[0] == 200
        stream[1].write(b"GET /ok HTTP/1.1\r\n")
        assert await closed(stream[0])


@pytest.mark.anyio
async def test_the_deadline_never_cuts_a_request_in_progress() -> None:
    app = small_app()
    async with guarded(app, ConnectionLimits(100, header_timeout=0.3)) as (port, _):
        stream = await connect(port)
        stream[1].write(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await still_open(stream[0], 1.0)
        app[WAIT].set()
        assert (await response(stream[0]))[2] == b"waited"


@pytest.mark.anyio
async def test_at_the_cap_a_new_connection_closes_the_longest_waiting_one() -> None:
    async with guarded(small_app(), ConnectionLimits(2, header_timeout=60)) as (port, conns):
        idle = await connect(port)
        assert (await get(idle, "/ok"))[0] == 200
        partial = await connect(port)
        partial[1].write(SLOW_HEAD)
        await until(lambda: conns.open == 2)
        assert (await get(await connect(port), "/ok"))[0] == 200  # the idle one made room
        assert await closed(idle[0])
        assert await still_open(partial[0], 0.2)


@pytest.mark.anyio
async def test_a_body_still_arriving_makes_room_when_nothing_waits() -> None:
    async with guarded(small_app(), ConnectionLimits(1, header_timeout=60)) as (port, conns):
        uploading = await connect(port)
        head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n"
        uploading[1].write(head + b"abc")
        await until(lambda: conns.open == 1)
        await asyncio.sleep(0.1)  # its head parsed, its handler reading the body
        assert (await get(await connect(port), "/ok"))[0] == 200
        assert await closed(uploading[0])


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("request_head", "status"),
    [
        (b"GET /ok HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"\x16\x03\x01 not http\r\n\r\n", 400),
    ],
    ids=["bad_header", "line_too_long", "not_http"],
)
async def test_a_malformed_request_is_answered_in_the_envelope_without_a_traceback(
    request_head: bytes, status: int, capsys: pytest.CaptureFixture[str]
) -> None:
    async with guarded(small_app(), ConnectionLimits(100, header_timeout=60)) as (port, _):
        reader, writer = await connect(port)
        writer.write(request_head)
        answered, headers, body = await response(reader)
        assert headers["Content-Type"].startswith("application/json")
        error = json.loads(body)["error"]
        assert (answered, error["type"]) == (status, "invalid_request_error")
        assert error["message"].startswith("The HTTP request could not be parsed: ")
        assert await closed(reader)
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.anyio
async def test_with_every_connection_busy_a_new_one_is_refused_with_a_clean_503() -> None:
    app = small_app()
    async with guarded(app, ConnectionLimits(2, header_timeout=60)) as (port, conns):
        busy = [await connect(port) for _ in range(2)]
        for _, writer in busy:
            writer.write(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        await until(lambda: len(app[WAITING]) == 2)
        refused = await connect(port)
        refused[1].write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = await response(refused[0])
        assert status == 503 and headers["Retry-After"] == "1"
        assert headers["Connection"] == "close" and headers["X-Request-Id"].startswith("req_")
        error = json.loads(body)["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "server_error",
            "too_many_connections",
            None,
        )
        assert await closed(refused[0])
        app[WAIT].set()
        for reader, _ in busy:
            assert (await response(reader))[2] == b"waited"
        assert (await get(await connect(port), "/ok"))[0] == 200
        assert conns.open <= 2


@pytest.mark.anyio
async def test_over_tls_too(tmp_path: Path) -> None:
    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_tls)
    client_tls = ssl.create_default_context()
    ca.configure_trust(client_tls)
    app = small_app()
    limits = ConnectionLimits(1, header_timeout=0.5)
    async with guarded(app, limits, server_tls) as (port, _):
        assert (await get(await connect(port, client_tls), "/ok"))[0] == 200  # then idle
        busy = await connect(port, client_tls)  # makes room, then holds the one slot
        busy[1].write(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        await until(lambda: len(app[WAITING]) == 1)
        refused = await get(await connect(port, client_tls), "/ok")
        assert refused[0] == 503 and json.loads(refused[2])["error"]["code"]
        app[WAIT].set()
        assert (await response(busy[0]))[2] == b"waited"
        partial = await connect(port, client_tls)
        partial[1].write(SLOW_HEAD)
        assert await closed(partial[0])


# The accept loop's resource errors, the limits and the flags.


@pytest.mark.anyio
async def test_accept_errors_are_one_line_an_interval_without_tracebacks() -> None:
    loop = asyncio.get_running_loop()
    others: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: others.append(context))
    try:
        with structlog.testing.capture_logs() as logs:
            log_accept_errors(loop, interval=0.2)
            for _ in range(1000):
                exc = OSError(errno.EMFILE, os.strerror(errno.EMFILE))
                loop.call_exception_handler({"message": ACCEPT_ERROR, "exception": exc})
            loop.call_exception_handler({"message": "something else"})
            await asyncio.sleep(0.6)
    finally:
        loop.set_exception_handler(None)
    lines = [e for e in logs if e["event"].startswith("cannot accept connections")]
    assert [(e["count"], e["errors"], e["log_level"]) for e in lines] == [
        (1, ["EMFILE"], "warning"),
        (999, ["EMFILE"], "warning"),
    ]
    assert others == [{"message": "something else"}]


def test_the_open_file_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = (hard if hard != resource.RLIM_INFINITY else 4096) // 2
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        assert raise_open_file_limit() == (lowered, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_default_cap_leaves_the_server_its_own_descriptors() -> None:
    assert default_max_connections(1024) == 896
    assert default_max_connections(200) == 100
    assert default_max_connections(1_048_576) == 16384
    assert default_max_connections(resource.RLIM_INFINITY) == 16384


def test_the_flags() -> None:
    args = build_parser().parse_args([])
    assert (args.max_connections, args.header_timeout) == (None, 30.0)
    args = build_parser().parse_args(["--max-connections", "500", "--header-timeout", "5"])
    assert (args.max_connections, args.header_timeout) == (500, 5.0)
    with pytest.raises(ValueError, match="--max-connections"):
        ConnectionLimits(0)
    with pytest.raises(ValueError, match="--header-timeout"):
        ConnectionLimits(10, header_timeout=0)


def test_a_bad_limit_is_a_one_line_start_up_error(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-P", "-m", "sluice", "--max-connections", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # nothing is created: the flags are checked first
    )
    assert out.returncode == 2
    assert "sluice: error: --max-connections must be at least 1, not 0" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.anyio
async def test_the_apps_handler_options_reach_its_connections() -> None:
    async with guarded(small_app({"max_line_size": 64}), ConnectionLimits(10)) as (port, _):
        assert (await get(await connect(port), "/ok"))[0] == 200
        assert (await get(await connect(port), "/ok?" + "x" * 100))[0] == 400

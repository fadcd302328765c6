"""SIGTERM and SIGINT against a real ``python -P -m sluice`` with the real model: the
port opens while the model loads (503), in-flight streams finish within
``--shutdown-timeout``, the rest end with an error event, new connections are
refused, and the process exits 0. Each test starts its own server."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DEFAULT_GGUF, MODEL_NAME, REPO, free_port, missing_model

pytestmark = pytest.mark.model


@contextmanager
def sluice(tmp_path: Path, *flags: str) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    if not DEFAULT_GGUF.exists():
        missing_model(f"default model missing at {DEFAULT_GGUF}: run `make model`")
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [
        sys.executable, "-P", "-m", "sluice",
        "--model-path", str(DEFAULT_GGUF),
        "--dtype", "float32", "--quantization", "none",  # the greedy outputs the tests expect
        "--port", str(port),
        "--responses-db", ":memory:",
        "--log-format", "json",
        *flags,
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        yield proc, port, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def health(port: int) -> int | None:
    """``/health``'s status, or None while nothing listens."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


def wait_for_health(
    proc: subprocess.Popen[bytes], port: int, log: Path, want: set[int]
) -> list[int]:
    """Poll until ``/health`` answers one of ``want``; the statuses seen on the way."""
    seen: list[int] = []
    deadline = time.monotonic() + 300
    while not (seen and seen[-1] in want):
        assert proc.poll() is None, f"server exited:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no healthy server:\n{log.read_text()[-4000:]}"
        status = health(port)
        if status is not None:
            seen.append(status)
        time.sleep(0.02)
    return seen


class Stream:
    """A streaming completion read frame by frame."""

    def __init__(self, port: int, max_tokens: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = {
            "model": MODEL_NAME,
            "prompt": "Count to one thousand: 1, 2, 3,",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        self.conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        self.response = self.conn.getresponse()
        assert self.response.status == 200

    def frame(self) -> str | None:
        """The next frame's data, or None at the end of the body."""
        data = ""
        while line := self.response.readline():
            text = line.decode().rstrip("\r\n")
            if text.startswith("data: "):
                data += text[6:]
            elif not text and data:
                return data
        return None

    def rest(self) -> list[str]:
        frames = []
        while (frame := self.frame()) is not None:
            frames.append(frame)
        self.conn.close()
        return frames


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def log_events(log: Path) -> list[dict[str, Any]]:
    events = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            events.append(json.loads(line))
    return events


def test_sigterm_drains_in_flight_streams_then_ends_the_rest(tmp_path: Path) -> None:
    # Generous: a busy two-core machine can take a second a token. One engine thread
    # keeps OpenMP barriers from spinning against whatever else runs.
    grace_s = 15.0
    flags = ("--shutdown-timeout", str(grace_s), "--threads", "1")
    with sluice(tmp_path, *flags) as (proc, port, log):
        seen = wait_for_health(proc, port, log, want={200})
        assert 503 in seen, "the port should answer 503 while the model loads"
        short = Stream(port, max_tokens=4)
        long = Stream(port, max_tokens=4000)
        # Both are admitted (their headers came) and neither can have finished yet.
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        deadline = signalled + 5
        while not refused(port):
            assert time.monotonic() < deadline, "new connections still accepted"
            time.sleep(0.05)

        short_frames = short.rest()
        first = json.loads(short_frames[0])
        assert short_frames[-1] == "[DONE]"
        assert not any('"error"' in f for f in short_frames)
        long_frames = long.rest()
        ended = time.monotonic() - signalled
        error = json.loads(long_frames[-1])["error"]
        assert error["message"] == "the server is shutting down"
        assert error["code"] == "shutting_down"
        assert "[DONE]" not in long_frames
        assert grace_s - 1 <= ended < grace_s + 10
        assert proc.wait(timeout=30) == 0

    # The short stream was still running when shutdown began: it ended after it.
    events = [e["event"] if e.get("request_id") != first["id"] else "short done"
              for e in log_events(log)
              if e["event"] in {"shutting down", "request done"}]  # fmt: skip
    assert events.index("shutting down") < events.index("short done")


def test_sigint_while_loading_exits_0(tmp_path: Path) -> None:
    with sluice(tmp_path) as (proc, port, log):
        wait_for_health(proc, port, log, want={503, 200})
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in log.read_text()

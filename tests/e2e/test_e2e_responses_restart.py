"""Stored responses outlive the server: a real ``python -P -m sluice`` with the real model
stores a response in its ``--responses-db``, stops (SIGTERM), and a new server on the same
file retrieves it, lists its input items and continues it with ``previous_response_id``.

This module starts its own servers (one at a time, like ``test_shutdown``) and never uses
the shared session server.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from tests.conftest import DEFAULT_GGUF, MODEL_NAME, REPO, free_port, missing_model
from tests.support.e2e_responses import FRANCE, FRANCE_ANSWER, ITALY, ITALY_FOLLOW_UP
from tests.support.responses_spec import check_response

pytestmark = pytest.mark.model


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@contextmanager
def sluice(db: Path, log: Path) -> Iterator[openai.OpenAI]:
    """A server on ``db``, healthy; stopped with SIGTERM (a clean shutdown) at the end."""
    if not DEFAULT_GGUF.exists():
        missing_model(f"default model missing at {DEFAULT_GGUF}: run `make model`")

    port = free_port()
    cmd = [
        sys.executable, "-P", "-m", "sluice",
        "--model-path", str(DEFAULT_GGUF),
        "--dtype", "float32", "--quantization", "none",  # the greedy outputs the tests expect
        "--port", str(port),
        "--responses-db", str(db),
        "--log-format", "json",
    ]  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 300
        while not _healthy(port):
            assert proc.poll() is None, f"server exited:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no healthy server:\n{log.read_text()[-4000:]}"
            time.sleep(0.2)
        with openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
        ) as client:
            yield client
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stored_response_survives_a_restart(tmp_path: Path) -> None:
    db, log = tmp_path / "responses.sqlite3", tmp_path / "server.log"
    with sluice(db, log) as client:
        raw = client.responses.with_raw_response.create(
            model=MODEL_NAME, input=FRANCE, temperature=0, max_output_tokens=24
        )
        before = check_response(raw.http_response.json())
        assert before["output"][0]["content"][0]["text"] == FRANCE_ANSWER
    assert db.exists()
    with sluice(db, log) as client:
        after = client.responses.with_raw_response.retrieve(before["id"]).http_response.json()
        assert after == before
        [item] = list(client.responses.input_items.list(before["id"]))
        assert item.type == "message" and item.content[0].text == FRANCE  # type: ignore[union-attr]
        follow = client.responses.create(
            model=MODEL_NAME, input=ITALY, previous_response_id=before["id"], temperature=0,
            max_output_tokens=24,
        )  # fmt: skip
        assert follow.output_text == ITALY_FOLLOW_UP
        assert follow.usage is not None
        assert follow.usage.input_tokens > before["usage"]["total_tokens"]

"""``--dtype auto`` as a user meets it: two servers started at the same moment on one
machine serve in the same precision (one measures, the other waits and reads its
decision), and each says in ``/server_info`` what it chose and why. Before, each timed
the GEMMs against the other's timing and a busy start could take fp32 where a quiet
one took bf16. Runs after the shared server has answered; its two servers load
together, as the case needs."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest

from sluice.engine.cpu import host_cpu
from tests.conftest import DEFAULT_GGUF, MODEL_NAME, missing_model, spawn_server, wait_healthy
from tests.support.plain_http import get

pytestmark = pytest.mark.model


def test_two_servers_started_together_choose_alike(tmp_path: Path) -> None:
    if not DEFAULT_GGUF.exists():
        missing_model("default model missing: run `make model`")
    env = {"SLUICE_PRECISION_CACHE": str(tmp_path / "precision")}  # nothing decided yet
    workdirs = [tmp_path / "a", tmp_path / "b"]
    for workdir in workdirs:
        workdir.mkdir()
    with ExitStack() as stack:
        started = [
            stack.enter_context(spawn_server(DEFAULT_GGUF, workdir, MODEL_NAME,
                                             "--dtype", "auto", "--threads", "1", env=env))
            for workdir in workdirs
        ]  # fmt: skip
        for server, proc, log in started:
            wait_healthy(server, proc, log)
        infos = [get(f"{server.base_url}/server_info").json() for server, _, _ in started]
    choices = [info["dtype_choice"] for info in infos]
    assert infos[0]["dtype"] == infos[1]["dtype"] == choices[0]["dtype"] == choices[1]["dtype"]
    if host_cpu().native_bf16:  # one timed the GEMMs (three times); the other read it
        assert sorted(c["reason"] for c in choices) == ["measured", "measured earlier"]
        assert choices[0]["speedup"] == choices[1]["speedup"] > 0
        assert len(choices[0]["measurements"]) == 3
        assert len(list((tmp_path / "precision").glob("*.json"))) == 1
    else:
        assert [c["reason"] for c in choices] == ["no bf16 arithmetic"] * 2
    assert all(c["cpu"] == host_cpu().line() for c in choices)

"""Sluice's engine with no HTTP, in its own process, as the load generator's system B.

The load generator runs the HTTP server's rounds and this worker's rounds interleaved
(A B A B …) with the same prompts, so that "server ÷ engine-only" is a ratio from one
run like every other, not two runs minutes apart. The worker (``engine_only --worker``)
is started before the load generator lowers its own priority, so the engine runs at
the server's priority; it holds its model but no CPU between rounds, as the server
holds its own while the worker runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from sluice.bench.stats import RequestRecord, RunResult, summarise


class EngineWorkerError(Exception):
    """The worker died or answered something other than its protocol."""


class EngineWorker:
    def __init__(
        self,
        *,
        threads: int | None = None,
        dtype: str = "auto",
        model_path: str | None = None,
        max_running: int = 64,
        command: list[str] | None = None,
    ) -> None:
        """``command`` replaces the worker's (a test's stand-in speaking the protocol)."""
        cmd = [sys.executable, "-P", "-m", "sluice.bench.engine_only", "--worker",
               "--dtype", dtype, "--max-running", str(max_running)]  # fmt: skip
        if threads:
            cmd += ["--threads", str(threads)]
        if model_path:
            cmd += ["--model-path", model_path]
        if command is not None:
            cmd = command
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._started = False

    def _answer(self) -> dict[str, Any]:
        """The next JSON object on the worker's stdout (a library's stray print is skipped)."""
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                answer = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(answer, dict):
                if "error" in answer:
                    raise EngineWorkerError(answer["error"])
                return answer
        raise EngineWorkerError(f"the engine worker exited ({self._proc.wait()})")

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        if not self._started:
            self._answer()  # {"ready": true} once the model is loaded
            self._started = True
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        return self._answer()

    def run(self, concurrency: int, prompts: list[str], max_tokens: int, label: str) -> RunResult:
        """The prompts closed loop at ``concurrency``, greedy, ``ignore_eos``."""
        answer = self._ask(
            {"op": "run", "concurrency": concurrency, "prompts": prompts, "max_tokens": max_tokens}
        )
        records = [RequestRecord(**r) for r in answer["records"]]
        return summarise(records, answer["wall_s"], label=label, concurrency=concurrency)

    def ceiling(self, batch: int, context: int) -> dict[str, Any]:
        """One raw batched decode step at ``batch`` rows of ``context`` cached positions."""
        return self._ask({"op": "ceiling", "batch": batch, "context": context})

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

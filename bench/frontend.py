"""The front end alone: Sluice's HTTP + pipeline + projections over an engine that costs
nothing, against the bare aiohttp handler of ``floor_server``.

    python -P -m sluice.bench.frontend --concurrency 16,64

Each system runs in its own process (Sluice with ``SyntheticEngine``: no model, the
real tokenizer, one batch of events per engine step as ``TorchEngine`` delivers them),
and the two are driven interleaved (A B A B …) by this process at lower priority. The
numbers are the server process's own CPU time (``/proc/PID/stat``) ÷ streamed tokens,
and unary (``stream: false``) requests per second in a closed loop. No model is
loaded, so this may run beside a model-backed job.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from sluice.bench.load_client import LoadConfig, build_payload, make_prompt
from sluice.bench.loadgen import run_level
from sluice.bench.machine import print_machine
from sluice.bench.stats import ratio
from sluice.dataparallel.frontend import DataParallelEngine, WorkerCommand
from sluice.engine.interface import EngineBackend, EngineStats, EventSink
from sluice.engine.params import SequenceSpec
from sluice.events.types import EngineEvent, PromptProcessed, SequenceFinished, TokenSampled

PY = [sys.executable, "-P"]
_JSON = {"Content-Type": "application/json"}


# ------------------------------------------------------------------ the synthetic engine


@dataclass
class _Seq:
    spec: SequenceSpec
    sink: EventSink
    emitted: int = 0
    seq_no: int = 0


@dataclass
class SyntheticEngine(EngineBackend):
    """``EngineBackend`` with no model: every ``step_s`` seconds one step emits one token
    for every running sequence, batched per sink (one call per sink per step), so the
    front end sees the engine's real event shape at no engine cost."""

    tokens: Sequence[int]
    step_s: float = 0.005
    max_context: int = 8192
    running: dict[tuple[str, int], _Seq] = field(default_factory=dict)
    _handle: asyncio.TimerHandle | None = None
    generated: int = 0

    def submit(self, specs: Sequence[SequenceSpec], sink: EventSink) -> None:
        for spec in specs:
            self.running[spec.key] = _Seq(spec, sink)
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(self.step_s, self._step)

    def _step(self) -> None:
        self._handle = None
        batches: dict[EventSink, list[EngineEvent]] = {}
        for key, run in list(self.running.items()):
            spec = run.spec
            out = batches.setdefault(run.sink, [])
            if run.seq_no == 0:
                out.append(
                    PromptProcessed(spec.request_id, spec.choice_index, 0, len(spec.prompt_ids), 0)
                )
                run.seq_no = 1
            token = self.tokens[run.emitted % len(self.tokens)]
            run.emitted += 1
            self.generated += 1
            out.append(TokenSampled(spec.request_id, spec.choice_index, run.seq_no, token))
            run.seq_no += 1
            if run.emitted >= spec.sampling.max_tokens:
                out.append(
                    SequenceFinished(
                        spec.request_id, spec.choice_index, run.seq_no, "length", run.emitted
                    )
                )
                del self.running[key]
        for sink, events in batches.items():
            sink(events)
        if self.running:
            self._handle = asyncio.get_running_loop().call_later(self.step_s, self._step)

    def cancel(self, request_id: str, choice_index: int | None = None) -> None:
        for key, run in list(self.running.items()):
            if key[0] == request_id and choice_index in (None, key[1]):
                del self.running[key]
                run.sink([SequenceFinished(request_id, key[1], run.seq_no, "abort", run.emitted)])

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self.running), generated_tokens=self.generated)

    async def flush_cache(self) -> bool:
        return not self.running


def serve_synthetic(port: int, step_s: float, model_path: str | None, dp_size: int = 1) -> None:
    """Sluice's real app (routes, middleware, pipeline, projections) over the synthetic
    engine and the default model's real tokenizer (the weights are never loaded)."""
    from aiohttp import web

    from sluice.engine.loader import load_tokenizer, resolve_model
    from sluice.http.admission import Admission
    from sluice.http.app import create_app
    from sluice.http.state import ServerState
    from sluice.logging import configure_logging
    from sluice.pipeline.chat import ChatSetup
    from sluice.pipeline.runner import PipelineContext
    from sluice.pipeline.token_text import TokenTexts

    configure_logging("console", "warning")  # as the bench runs the real server
    tokenizer = load_tokenizer(resolve_model(model_path).folder)
    # Ordinary English text: the detokenizer sees the kind of tokens a model emits.
    tokens = tokenizer.encode(" The quick brown fox jumps over the lazy dog, and then it rests.")
    engine: EngineBackend = SyntheticEngine(tokens, step_s=step_s)
    if dp_size > 1:  # the same engine in worker processes, behind the process boundary
        engine = DataParallelEngine(synthetic_workers(step_s, tokens), dp_size)
    pipeline = PipelineContext(engine, tokenizer, TokenTexts(tokenizer), 8192)
    state = ServerState(
        pipeline,
        "synthetic",
        chat=ChatSetup.for_tokenizer(None, tokenizer),
        admission=Admission(max_running=256, max_queued=1024),
    )
    app = create_app(state)

    async def start(app: web.Application) -> None:
        await engine.start()

    async def stop(app: web.Application) -> None:
        await engine.close()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def synthetic_workers(step_s: float, tokens: Sequence[int]) -> WorkerCommand:
    """The command of a synthetic engine worker (``bench.synthetic_worker``)."""

    def command(rank: int, socket: str) -> list[str]:
        return [*PY, "-m", "sluice.bench.synthetic_worker", socket, str(rank), str(step_s),
                ",".join(map(str, tokens))]  # fmt: skip

    return command


# ------------------------------------------------------------------------- the driver


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def _wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{url}: the server did not come up")


@dataclass
class Measure:
    label: str
    concurrency: int
    streamed_tokens: int = 0
    stream_cpu_s: float = 0.0
    stream_errors: int = 0
    unary_requests: int = 0
    unary_wall_s: float = 0.0
    unary_cpu_s: float = 0.0
    unary_errors: int = 0
    error_messages: list[str] = field(default_factory=list)

    @property
    def us_per_token(self) -> float | None:
        return self.stream_cpu_s / self.streamed_tokens * 1e6 if self.streamed_tokens else None

    @property
    def unary_req_s(self) -> float | None:
        return self.unary_requests / self.unary_wall_s if self.unary_wall_s else None

    @property
    def unary_us_cpu(self) -> float | None:
        return self.unary_cpu_s / self.unary_requests * 1e6 if self.unary_requests else None

    def to_dict(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in vars(self).items()},
            "us_cpu_per_streamed_token": self.us_per_token,
            "unary_req_per_s": self.unary_req_s,
            "us_cpu_per_unary_request": self.unary_us_cpu,
        }


async def _unary_loop(
    session: aiohttp.ClientSession, cfg: LoadConfig, concurrency: int, total: int, salt: str
) -> tuple[int, int, float]:
    rng = random.Random(f"unary/{concurrency}/{salt}")
    path = "/v1/chat/completions" if cfg.api == "chat" else "/v1/completions"
    issued = ok = errors = 0

    async def worker() -> None:
        nonlocal issued, ok, errors
        while issued < total:
            issued += 1
            payload = build_payload(cfg, make_prompt(rng, cfg.prompt_words))
            payload["stream"] = False
            payload.pop("stream_options", None)
            async with session.post(
                cfg.url + path, data=orjson.dumps(payload), headers=_JSON
            ) as resp:
                await resp.read()
                if resp.status == 200:
                    ok += 1
                else:
                    errors += 1

    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(worker())
    return ok, errors, time.perf_counter() - start


async def measure_round(
    session: aiohttp.ClientSession,
    label: str,
    url: str,
    pid: int,
    args: argparse.Namespace,
    concurrency: int,
    salt: str,
) -> Measure:
    m = Measure(label, concurrency)
    cfg = LoadConfig(
        url=url, model="synthetic", api=args.api, max_tokens=args.max_tokens, label=label
    )
    n = args.requests or max(4 * concurrency, 32)
    before = cpu_seconds(pid)
    run = await run_level(session, cfg, concurrency, requests=n, salt=salt)
    m.stream_cpu_s = cpu_seconds(pid) - before
    m.streamed_tokens = sum(r.output_tokens for r in run.records if r.error is None)
    m.stream_errors = run.errors
    m.error_messages = run.error_messages[:2]
    unary_cfg = LoadConfig(url=url, model="synthetic", api=args.api, max_tokens=args.unary_tokens)
    before = cpu_seconds(pid)
    ok, errors, wall = await _unary_loop(session, unary_cfg, concurrency, n, salt)
    m.unary_cpu_s = cpu_seconds(pid) - before
    m.unary_requests, m.unary_errors, m.unary_wall_s = ok, errors, wall
    return m


def _pool(ms: list[Measure]) -> Measure:
    out = Measure(ms[0].label, ms[0].concurrency)
    for m in ms:
        out.streamed_tokens += m.streamed_tokens
        out.stream_cpu_s += m.stream_cpu_s
        out.stream_errors += m.stream_errors
        out.unary_requests += m.unary_requests
        out.unary_wall_s += m.unary_wall_s
        out.unary_cpu_s += m.unary_cpu_s
        out.unary_errors += m.unary_errors
        out.error_messages += m.error_messages
    return out


async def drive(args: argparse.Namespace, servers: dict[str, tuple[str, int]]) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=2 * max(args.levels) + 8, limit_per_host=0)
    results: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(connector=connector) as session:
        for label, (url, pid) in servers.items():  # warm-up, unmeasured
            await measure_round(session, label, url, pid, args, 4, "warmup")
        for c in args.levels:
            rounds: dict[str, list[Measure]] = {label: [] for label in servers}
            for r in range(args.rounds):
                for label, (url, pid) in servers.items():
                    rounds[label].append(
                        await measure_round(session, label, url, pid, args, c, f"r{r}")
                    )
            pooled = {label: _pool(ms) for label, ms in rounds.items()}
            results.append({"concurrency": c, **{k: v.to_dict() for k, v in pooled.items()}})
    return {"frontend": results}


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(report: dict[str, Any]) -> str:
    lines = [
        "front end over a synthetic engine (server process CPU; client niced)",
        f"{'C':>4}  {'system':<8}{'µs CPU/token':>14}{'unary req/s':>13}{'µs CPU/unary':>14}"
        f"{'errors':>8}",
    ]
    for level in report["frontend"]:
        for label in ("sluice", "floor"):
            m = level.get(label)
            if m is None:
                continue
            tok = m["us_cpu_per_streamed_token"]
            req = m["unary_req_per_s"]
            unary = m["us_cpu_per_unary_request"]
            lines.append(
                f"{level['concurrency']:>4}  {label:<8}{_num(tok, 1):>14}{_num(req, 0):>13}"
                f"{_num(unary, 0):>14}{m['stream_errors'] + m['unary_errors']:>8}"
            )
        for label in ("sluice", "floor"):
            m = level.get(label)
            if m is not None:
                lines.extend(f"      {label} error: {e}" for e in m["error_messages"])
        s, f = level.get("sluice"), level.get("floor")
        if s and f:
            tok_r = ratio(s["us_cpu_per_streamed_token"], f["us_cpu_per_streamed_token"])
            req_r = ratio(s["unary_req_per_s"], f["unary_req_per_s"])
            lines.append(
                f"{'':>4}  sluice ÷ floor: CPU/token {tok_r or float('nan'):.2f}×, "
                f"unary req/s {req_r or float('nan'):.2f}×"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -P -m sluice.bench.frontend", description=__doc__)
    p.add_argument("--concurrency", default="16,64")
    p.add_argument("--requests", type=int, help="per level and round (default 4×C, min 32)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--api", choices=("completions", "chat"), default="completions")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--unary-tokens", type=int, default=16, help="max_tokens of unary requests")
    p.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="synthetic engine step period (0: every loop turn)",
    )
    p.add_argument("--model-path", help="whose tokenizer to use (default: the default model)")
    p.add_argument("--port", type=int, default=8791, help="Sluice's; the floor gets port+1")
    p.add_argument("--json", type=Path)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dp-size", type=int, default=1, help=argparse.SUPPRESS)  # with --serve
    args = p.parse_args(argv)
    print_machine()
    if args.serve:
        serve_synthetic(args.port, args.step_ms / 1000, args.model_path, args.dp_size)
        return 0
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    sluice_cmd = [*PY, "-m", "sluice.bench.frontend", "--serve", "--port", str(args.port),
                  "--step-ms", str(args.step_ms)]  # fmt: skip
    if args.model_path:
        sluice_cmd += ["--model-path", args.model_path]
    floor_cmd = [*PY, "-m", "sluice.bench.floor_server", "--port", str(args.port + 1)]
    with (
        subprocess.Popen(sluice_cmd) as sluice,
        subprocess.Popen(floor_cmd, stdout=subprocess.DEVNULL) as floor,
    ):
        try:
            servers = {
                "sluice": (f"http://127.0.0.1:{args.port}", sluice.pid),
                "floor": (f"http://127.0.0.1:{args.port + 1}", floor.pid),
            }
            for (url, _), proc in zip(servers.values(), (sluice, floor), strict=True):
                _wait_up(url, proc)
            os.nice(10)  # the servers keep the CPU they need; the client takes what is left
            report = asyncio.run(drive(args, servers))
        finally:
            for proc in (sluice, floor):
                proc.terminate()
            for proc in (sluice, floor):
                proc.wait(timeout=30)
    print(format_table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

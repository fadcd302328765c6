"""``--dp-size`` measured, two ways, each as an interleaved A B A B run:

    python -P -m sluice.bench.data_parallel [--part boundary,affinity]

``boundary``: what the process boundary adds per request. The front end over the
synthetic engine (no model, one token per step) in its own process (``--dp-size 1``)
against the same engine in two worker processes (``--dp-size 2``), streaming at
C = 1 and 16: per-request TTFT and end-to-end p50, and the difference.

``shared``: a chat workload whose requests share an ≈80-word system prompt (what every
chat application sends), streamed at C = 16 and 64: ``--dp-size 2`` (one thread each)
against ``--dp-size 1`` (two threads), rounds interleaved: output tok/s, TTFT p99, and
each rank's sequences and prefix-cache hit rate (``/v1/loads``, ``/metrics``).

``affinity``: what prefix affinity does to the prefix cache. The real default model
with ``--dp-size 2 --threads 1`` under ``--load-balance-method cache_aware`` and
``least_load``, on a shared-prefix workload (4 long documents, 8 questions each, in
shuffled order, C = 4): cached prompt tokens ÷ prompt tokens, from each response's
``usage``.

Every server's command line is printed. Numbers go to ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from sluice.bench.load_client import LoadConfig
from sluice.bench.loadgen import run_level
from sluice.bench.machine import print_machine
from sluice.bench.stats import percentile, ratio

PY = [sys.executable, "-P"]
REPO = Path(__file__).resolve().parents[1]
DEFAULT_GGUF = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
_JSON = {"Content-Type": "application/json"}
LOGS = REPO / "build" / "bench" / "data_parallel"  # each server's log


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    """Until ``url`` answers ``/health`` with 200 (its model loaded); exits where the
    server process ends first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise SystemExit(f"{url}: the server did not come up")


class Servers:
    """Start the servers (printing each command line), wait for them, stop them."""

    def __init__(self, commands: dict[str, tuple[list[str], int]]) -> None:
        self.commands = commands
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> dict[str, str]:
        urls = {}
        LOGS.mkdir(parents=True, exist_ok=True)
        for label, (cmd, port) in self.commands.items():
            print(f"{label}: {' '.join(cmd)}", flush=True)
            with (LOGS / f"{label}.log").open("wb") as log:
                self.procs[label] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            urls[label] = f"http://127.0.0.1:{port}"
        for label, url in urls.items():
            wait_up(url, self.procs[label])
        return urls

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            proc.wait(timeout=60)


# ------------------------------------------------------------------------ boundary


async def boundary(args: argparse.Namespace) -> list[dict[str, Any]]:
    commands = {
        f"dp{n}": ([*PY, "-m", "sluice.bench.frontend", "--serve", "--port", str(port),
                    "--step-ms", str(args.step_ms), "--dp-size", str(n)], port)
        for n, port in ((1, args.port), (2, args.port + 1))
    }  # fmt: skip
    results = []
    with Servers(commands) as urls:
        os.nice(10)  # the servers keep the CPU they need; the client takes what is left
        async with aiohttp.ClientSession() as session:
            for c in args.levels:
                samples: dict[str, dict[str, list[float]]] = {
                    label: {"ttft": [], "e2e": []} for label in urls
                }
                for r in range(args.rounds):
                    for label, url in urls.items():
                        cfg = LoadConfig(url=url, model="synthetic", max_tokens=args.max_tokens,
                                         label=label)  # fmt: skip
                        run = await run_level(session, cfg, c, requests=max(8 * c, 32),
                                              salt=f"r{r}")  # fmt: skip
                        ok = [rec for rec in run.records if rec.error is None]
                        samples[label]["ttft"] += [rec.ttft_s for rec in ok if rec.ttft_s]
                        samples[label]["e2e"] += [rec.latency_s for rec in ok]
                row: dict[str, Any] = {"concurrency": c}
                for label, values in samples.items():
                    row[label] = {k: percentile(v, 50) * 1000 for k, v in values.items()}
                row["added_ms"] = {k: row["dp2"][k] - row["dp1"][k] for k in ("ttft", "e2e")}
                results.append(row)
    return results


def format_boundary(rows: list[dict[str, Any]], max_tokens: int) -> str:
    lines = [f"process boundary (synthetic engine, {max_tokens} tokens a request, p50 ms)",
             f"{'C':>4}{'TTFT dp1':>10}{'TTFT dp2':>10}{'added':>8}"
             f"{'e2e dp1':>10}{'e2e dp2':>10}{'added':>8}{'e2e ÷':>8}"]  # fmt: skip
    for row in rows:
        d1, d2, add = row["dp1"], row["dp2"], row["added_ms"]
        lines.append(
            f"{row['concurrency']:>4}{d1['ttft']:>10.2f}{d2['ttft']:>10.2f}{add['ttft']:>8.2f}"
            f"{d1['e2e']:>10.1f}{d2['e2e']:>10.1f}{add['e2e']:>8.2f}"
            f"{ratio(d2['e2e'], d1['e2e']) or float('nan'):>8.3f}"
        )
    return "\n".join(lines)


# -------------------------------------------------------------------------- shared

SYSTEM_PROMPT = (
    "You are a helpful assistant for a small bookshop. Answer in one short sentence. "
    "Be polite and concrete, never invent titles or prices, and when you are unsure say "
    "so. The shop opens at nine and closes at six, sells new and second-hand books, "
    "orders any book in print within three days, and runs a reading group on the first "
    "Monday of each month. Customers may reserve books by phone or in person."
)


def _ranks(url: str) -> dict[str, dict[str, float]]:
    """Each rank's sequences routed (``--dp-size`` > 1) and its cache hit rate so far."""
    with urllib.request.urlopen(f"{url}/v1/loads", timeout=10) as r:
        loads = orjson.loads(r.read())["loads"]
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    routed = {
        line.split('"')[1]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("sluice_dp_routed_sequences_total{")
    }
    return {
        str(load["dp_rank"]): {"cache_hit_rate": load["cache_hit_rate"],
                               "routed": routed.get(str(load["dp_rank"]), float("nan"))}
        for load in loads
    }  # fmt: skip


async def shared(args: argparse.Namespace) -> list[dict[str, Any]]:
    base = [*PY, "-m", "sluice", "--model-path", str(args.model_path), "--dtype", "float32",
            "--responses-db", ":memory:"]  # fmt: skip
    commands = {
        "dp2": ([*base, "--dp-size", "2", "--threads", "1", "--port", str(args.port + 4)],
                args.port + 4),
        "dp1": ([*base, "--dp-size", "1", "--threads", "2", "--port", str(args.port + 5)],
                args.port + 5),
    }  # fmt: skip
    rows = []
    with Servers(commands) as urls:
        os.nice(10)
        async with aiohttp.ClientSession() as session:
            for c in args.shared_levels:
                pooled: dict[str, dict[str, Any]] = {
                    label: {"tokens": 0, "wall": 0.0, "ttft": []} for label in urls
                }
                for r in range(args.rounds):
                    for label, url in urls.items():
                        cfg = LoadConfig(url=url, model="SmolLM2-135M-Instruct", api="chat",
                                         max_tokens=args.max_tokens, label=label,
                                         system_prompt=SYSTEM_PROMPT, prompt_words=12)  # fmt: skip
                        run = await run_level(session, cfg, c, requests=4 * c, salt=f"s{r}")
                        ok = [rec for rec in run.records if rec.error is None]
                        pooled[label]["tokens"] += sum(rec.output_tokens for rec in ok)
                        pooled[label]["wall"] += run.wall_s
                        pooled[label]["ttft"] += [rec.ttft_s for rec in ok if rec.ttft_s]
                row: dict[str, Any] = {"concurrency": c}
                for label, p in pooled.items():
                    row[label] = {"tok_s": p["tokens"] / p["wall"],
                                  "ttft_p99_ms": percentile(p["ttft"], 99) * 1000,
                                  "ranks": _ranks(urls[label])}  # fmt: skip
                rows.append(row)
    return rows


def format_shared(rows: list[dict[str, Any]], max_tokens: int) -> str:
    lines = [f"shared system prompt (chat, {max_tokens} tokens a request, interleaved rounds)",
             f"{'C':>4}{'dp2 tok/s':>11}{'dp1 tok/s':>11}{'÷':>7}{'TTFT99 dp2':>12}"
             f"{'dp1':>8}  dp2 per rank: sequences, cache hit rate"]  # fmt: skip
    for row in rows:
        d2, d1 = row["dp2"], row["dp1"]
        ranks = ", ".join(f"rank {rank}: {v['routed']:.0f} seq, {v['cache_hit_rate']:.3f}"
                          for rank, v in sorted(d2["ranks"].items()))  # fmt: skip
        lines.append(
            f"{row['concurrency']:>4}{d2['tok_s']:>11.1f}{d1['tok_s']:>11.1f}"
            f"{ratio(d2['tok_s'], d1['tok_s']) or float('nan'):>7.2f}"
            f"{d2['ttft_p99_ms']:>12.0f}{d1['ttft_p99_ms']:>8.0f}  {ranks}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------ affinity


def shared_prefix_prompts(seed: int, documents: int, questions: int) -> list[str]:
    rng = random.Random(seed)
    words = ("river", "mountain", "harbour", "lantern", "orchard", "meadow", "signal",
             "granite", "willow", "compass", "ember", "tide", "quarry", "falcon")  # fmt: skip
    prompts = []
    for d in range(documents):
        document = " ".join(rng.choice(words) for _ in range(300))
        for q in range(questions):
            prompts.append(f"Document {d}: {document}\n\nQuestion {q}: which word comes first?")
    rng.shuffle(prompts)
    return prompts


async def _cached_ratio(
    session: aiohttp.ClientSession, url: str, prompts: Sequence[str], concurrency: int
) -> tuple[int, int]:
    queue = list(prompts)
    cached = total = 0

    async def worker() -> None:
        nonlocal cached, total
        while queue:
            body = {"model": "SmolLM2-135M-Instruct", "prompt": queue.pop(), "max_tokens": 4,
                    "temperature": 0}  # fmt: skip
            async with session.post(f"{url}/v1/completions", data=orjson.dumps(body),
                                    headers=_JSON) as resp:  # fmt: skip
                usage = (await resp.json())["usage"]
            total += usage["prompt_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]

    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(worker())
    return cached, total


async def affinity(args: argparse.Namespace) -> dict[str, Any]:
    base = [*PY, "-m", "sluice", "--model-path", str(args.model_path), "--dtype", "float32",
            "--dp-size", "2", "--threads", "1", "--responses-db", ":memory:"]  # fmt: skip
    commands = {
        method: ([*base, "--port", str(port), "--load-balance-method", method], port)
        for method, port in (("cache_aware", args.port + 2), ("least_load", args.port + 3))
    }
    totals = {method: [0, 0] for method in commands}
    with Servers(commands) as urls:
        async with aiohttp.ClientSession() as session:
            for r in range(args.rounds):
                prompts = shared_prefix_prompts(r, documents=4, questions=8)
                for method, url in urls.items():
                    async with session.post(f"{url}/flush_cache") as resp:
                        assert resp.status == 200, await resp.text()
                    cached, total = await _cached_ratio(session, url, prompts, 4)
                    totals[method][0] += cached
                    totals[method][1] += total
    return {method: {"cached_tokens": c, "prompt_tokens": t, "cached_share": c / t}
            for method, (c, t) in totals.items()}  # fmt: skip


def format_affinity(result: dict[str, Any]) -> str:
    lines = ["prefix affinity (--dp-size 2, 4 documents × 8 questions, C=4)",
             f"{'method':<18}{'cached':>10}{'prompt':>10}{'share':>8}"]  # fmt: skip
    for method, row in result.items():
        lines.append(f"{method:<18}{row['cached_tokens']:>10}{row['prompt_tokens']:>10}"
                     f"{row['cached_share']:>8.3f}")  # fmt: skip
    share = ratio(result["cache_aware"]["cached_share"], result["least_load"]["cached_share"])
    lines.append(f"cache_aware ÷ least_load cached share: {share or float('nan'):.2f}×")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -P -m sluice.bench.data_parallel",
                                description=__doc__)  # fmt: skip
    p.add_argument("--part", default="boundary,shared,affinity")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--shared-concurrency", default="16,64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=5.0, help="the synthetic engine's step")
    p.add_argument("--model-path", type=Path, default=DEFAULT_GGUF)
    p.add_argument("--port", type=int, default=8795)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    print_machine()
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.shared_levels = [int(c) for c in args.shared_concurrency.split(",") if c.strip()]
    parts = set(args.part.split(","))
    report: dict[str, Any] = {}
    if "boundary" in parts:
        report["boundary"] = asyncio.run(boundary(args))
        print(format_boundary(report["boundary"], args.max_tokens), flush=True)
    if "shared" in parts:
        report["shared"] = asyncio.run(shared(args))
        print(format_shared(report["shared"], args.max_tokens), flush=True)
    if "affinity" in parts:
        report["affinity"] = asyncio.run(affinity(args))
        print(format_affinity(report["affinity"]), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())

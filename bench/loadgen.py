"""Closed-loop load generator for any OpenAI-compatible server (docs/PERFORMANCE.md workload).

It prints ratios, not verdicts: with `--compare` two servers run interleaved (A B A B …) per
concurrency level, because on a shared, noisy machine only side-by-side ratios mean anything.

    python -m sluice.bench.loadgen --url http://127.0.0.1:8000 --concurrency 1,4,16,64
    python -m sluice.bench.loadgen --url http://127.0.0.1:8000 --compare http://127.0.0.1:8080 \
        --label-a sluice --label-b llama-server --json out.json
    python -m sluice.bench.loadgen --url http://127.0.0.1:8000 --compare-engine   # HTTP ÷ engine
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from .engine_worker import EngineWorker, EngineWorkerError
from .load_client import (
    Api,
    BenchError,
    LoadConfig,
    fetch_model,
    make_prompt,
    one_request,
    round_prompts,
)
from .machine import machine, print_machine
from .stats import (
    RequestRecord,
    RunResult,
    compare_results,
    pool,
    ratio,
    summarise,
)

__all__ = [
    "Api",
    "BenchError",
    "Comparison",
    "LoadConfig",
    "RunResult",
    "compare_level",
    "fetch_model",
    "main",
    "make_prompt",
    "one_request",
    "run_bench",
    "run_level",
    "summarise",
]


@dataclass(frozen=True)
class Comparison:
    """Interleaved runs of A and B at one concurrency level, pooled, with A ÷ B ratios."""

    concurrency: int
    a: RunResult
    b: RunResult
    rounds: list[tuple[RunResult, RunResult]]
    ratios: dict[str, float | None]

    def round_tok_ratios(self) -> list[float | None]:
        """Per-round output tok/s ratios: their spread shows how noisy the machine was."""
        return [compare_results(a, b)["output_tok_per_s"] for a, b in self.rounds]

    def to_dict(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "label_a": self.a.label,
            "label_b": self.b.label,
            **self.ratios,
            "output_tok_per_s_rounds": self.round_tok_ratios(),
        }


def default_requests(concurrency: int) -> int:
    """4 requests per worker (at least 8): enough to get past the ramp-up of a closed loop."""
    return max(4 * concurrency, 8)


async def run_level(
    session: aiohttp.ClientSession,
    cfg: LoadConfig,
    concurrency: int,
    *,
    requests: int | None = None,
    salt: str = "",
) -> RunResult:
    """Closed loop: `concurrency` workers, each sending its next request when the last ends.

    Runs `requests` (else cfg.requests, else cfg.duration seconds, else 4×C) requests.
    Prompts come from (seed, concurrency, salt), so A and B of a round get the same ones.
    """
    total = requests if requests is not None else cfg.requests
    if total is None and cfg.duration is None:
        total = default_requests(concurrency)
    rng = round_prompts(cfg.seed, concurrency, salt)
    records: list[RequestRecord] = []
    issued = 0
    start = time.perf_counter()
    deadline = start + cfg.duration if total is None and cfg.duration is not None else math.inf

    def more() -> bool:
        return issued < total if total is not None else time.perf_counter() < deadline

    async def worker() -> None:
        nonlocal issued
        while more():
            issued += 1
            records.append(await one_request(session, cfg, make_prompt(rng, cfg.prompt_words)))

    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(worker())
    wall = time.perf_counter() - start
    return summarise(records, wall, label=cfg.label, concurrency=concurrency)


RunRound = Callable[[int, str], Awaitable[RunResult]]


def http_rounds(session: aiohttp.ClientSession, cfg: LoadConfig) -> RunRound:
    """Rounds against a server over HTTP."""

    async def run(concurrency: int, salt: str) -> RunResult:
        return await run_level(session, cfg, concurrency, salt=salt)

    return run


def engine_rounds(worker: EngineWorker, cfg: LoadConfig, label: str) -> RunRound:
    """Rounds on Sluice's engine with no HTTP: A's prompts, A's request count, greedy with
    ``ignore_eos`` as the bench workload is."""

    async def run(concurrency: int, salt: str) -> RunResult:
        total = cfg.requests if cfg.requests is not None else default_requests(concurrency)
        rng = round_prompts(cfg.seed, concurrency, salt)
        prompts = [make_prompt(rng, cfg.prompt_words) for _ in range(total)]
        return await asyncio.to_thread(worker.run, concurrency, prompts, cfg.max_tokens, label)

    return run


async def compare_level(
    run_a: RunRound,
    run_b: RunRound,
    labels: tuple[str, str],
    concurrency: int,
    rounds: int,
) -> Comparison:
    """A B A B … at one level; each round gives both systems the same fresh prompts."""
    pairs: list[tuple[RunResult, RunResult]] = []
    for n in range(rounds):
        a = await run_a(concurrency, f"round{n}")
        b = await run_b(concurrency, f"round{n}")
        pairs.append((a, b))
    a_all = pool([a for a, _ in pairs], label=labels[0])
    b_all = pool([b for _, b in pairs], label=labels[1])
    return Comparison(concurrency, a_all, b_all, pairs, compare_results(a_all, b_all))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_results(results: Sequence[RunResult]) -> str:
    """A compact table (latencies in ms), then the first error messages of each run."""
    head = (
        f"{'label':<14}{'C':>5}{'n':>6}{'err':>5}{'req/s':>9}{'tok/s':>10}{'tok/req':>9}"
        f"{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
    )
    lines = [head]
    for r in results:
        lines.append(
            f"{r.label[:13]:<14}{r.concurrency:>5}{r.requests:>6}{r.errors:>5}"
            f"{r.req_per_s:>9.2f}{r.output_tok_per_s:>10.1f}{r.tokens_per_request:>9.1f}"
            f"{_ms(r.ttft.p50 if r.ttft else None):>10}{_ms(r.ttft.p99 if r.ttft else None):>10}"
            f"{_ms(r.itl.p50 if r.itl else None):>9}{_ms(r.itl.p99 if r.itl else None):>9}"
        )
    for r in results:
        lines.extend(f"  {r.label} C={r.concurrency} error: {m}" for m in r.error_messages)
    return "\n".join(lines)


def format_ratios(comparisons: Sequence[Comparison]) -> str:
    """A ÷ B per level; the last column is output tok/s A ÷ B of each round alone."""
    if not comparisons:
        return ""
    first = comparisons[0]
    lines = [
        f"ratios {first.a.label} ÷ {first.b.label}",
        f"{'C':>5}{'tok/s':>8}{'req/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'ITL p50':>9}{'ITL p99':>9}  tok/s per round",
    ]
    for c in comparisons:
        r = c.ratios
        per_round = " ".join(_x(v) for v in c.round_tok_ratios())
        lines.append(
            f"{c.concurrency:>5}{_x(r['output_tok_per_s']):>8}{_x(r['req_per_s']):>8}"
            f"{_x(r['ttft_p50']):>10}{_x(r['ttft_p99']):>10}"
            f"{_x(r['itl_p50']):>9}{_x(r['itl_p99']):>9}  {per_round}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sluice.bench.loadgen", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--url", required=True, help="base URL of server A, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model id for A (default: first id of GET /v1/models)")
    p.add_argument("--api", choices=("completions", "chat"), default="completions")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels")
    amount = p.add_mutually_exclusive_group()
    amount.add_argument("--requests", type=int, help="requests per level (default 4×C, min 8)")
    amount.add_argument("--duration", type=float, help="seconds per level instead of --requests")
    p.add_argument("--warmup", type=int, default=4, help="unmeasured requests per server first")
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--no-ignore-eos", action="store_true", help="omit ignore_eos (peers that reject it)"
    )
    p.add_argument("--no-ignore-eos-b", action="store_true", help="omit ignore_eos for B only")
    p.add_argument(
        "--no-done-b", action="store_true", help="B may end a stream without data: [DONE]"
    )
    p.add_argument("--api-key")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--json", type=Path, help="write every number to this JSON file")
    against = p.add_mutually_exclusive_group()
    against.add_argument("--compare", metavar="URL", help="server B, run interleaved A B A B …")
    against.add_argument(
        "--compare-engine",
        action="store_true",
        help="B is Sluice's engine with no HTTP in a worker process (completions only), "
        "fed the same prompts: A ÷ B is the server's cost over its own engine",
    )
    p.add_argument("--engine-dtype", default="auto", help="the engine worker's --dtype")
    p.add_argument("--engine-threads", type=int, help="the engine worker's torch threads")
    p.add_argument("--engine-model-path", help="the engine worker's model (default: the default)")
    p.add_argument(
        "--engine-ceiling",
        action="store_true",
        help="with --compare-engine: also time one raw batched decode step at the largest "
        "level (the engine ceiling) after each of the engine's rounds there, written to the "
        "JSON as raw_step with the engine's tok/s at that level ÷ the ceiling",
    )
    p.add_argument("--model-b", help="model id for B (default: first id of B's /v1/models)")
    p.add_argument("--rounds", type=int, default=2, help="A/B pairs per level with --compare")
    p.add_argument("--label-a", default="A")
    p.add_argument("--label-b", default="B")
    p.add_argument(
        "--no-nice", action="store_true", help="keep normal CPU priority (default: nice +10)"
    )
    args = p.parse_args(argv)
    try:
        args.levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        p.error(f"--concurrency: not a list of integers: {args.concurrency!r}")
    if not args.levels or min(args.levels) < 1:
        p.error("--concurrency needs levels ≥ 1")
    if args.rounds < 1:
        p.error("--rounds must be ≥ 1")
    if args.compare_engine and (args.duration is not None or args.api != "completions"):
        p.error("--compare-engine runs a number of completions: no --duration, --api completions")
    engine_flags = {
        "--engine-dtype": args.engine_dtype != "auto",
        "--engine-threads": args.engine_threads is not None,
        "--engine-model-path": args.engine_model_path is not None,
        "--engine-ceiling": args.engine_ceiling,
    }
    given = [flag for flag, set_ in engine_flags.items() if set_]
    if given and not args.compare_engine:
        p.error(f"{', '.join(given)} only apply with --compare-engine")
    if args.compare_engine and args.label_b == "B":
        args.label_b = "engine-only"
    return args


async def _warm(session: aiohttp.ClientSession, cfg: LoadConfig, n: int, levels: list[int]) -> None:
    """Unmeasured requests first, so lazy initialisation and first connections don't count."""
    if n <= 0:
        return
    res = await run_level(session, cfg, min(n, max(levels)), requests=n, salt="warmup")
    if res.errors:
        print(
            f"warning: {cfg.label} warmup: {res.errors}/{n} errors: {res.error_messages[0]}",
            file=sys.stderr,
        )


@dataclass(frozen=True)
class Report:
    config: dict[str, Any]
    results: list[RunResult]
    comparisons: list[Comparison]
    raw_step: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Every number, plus the config and machine line that docs/benchmarks.md quotes."""
        return {
            "config": self.config,
            "machine": machine(),
            "results": [r.to_dict() for r in self.results],
            "rounds": [
                {"concurrency": c.concurrency, "round": i, "a": a.to_dict(), "b": b.to_dict()}
                for c in self.comparisons
                for i, (a, b) in enumerate(c.rounds)
            ],
            "ratios": [c.to_dict() for c in self.comparisons],
            "raw_step": self.raw_step,
        }


def _timing_the_ceiling(
    run: RunRound, engine: EngineWorker, batch: int, context: int, steps: list[float]
) -> RunRound:
    """After each engine round at ``batch``, one raw decode step at ``batch`` rows: the
    ceiling is timed beside the rounds it is compared with, not once at the end."""

    async def run_then_time(concurrency: int, salt: str) -> RunResult:
        result = await run(concurrency, salt)
        if concurrency == batch:
            raw = await asyncio.to_thread(engine.ceiling, batch, context)
            steps.append(raw["step_s"])
        return result

    return run_then_time


def _ceiling_summary(
    comparisons: Sequence[Comparison], batch: int, context: int, steps: list[float]
) -> dict[str, Any] | None:
    """The median ceiling step, and the engine's pooled tok/s at ``batch`` rows ÷ it."""
    if not steps:
        return None
    step = statistics.median(steps)
    engine = next((c.b for c in comparisons if c.concurrency == batch), None)
    return {
        "batch": batch,
        "context": context,
        "step_s": step,
        "tok_s": batch / step,
        "rounds_step_s": steps,
        "engine_over_ceiling": ratio(engine.output_tok_per_s, batch / step) if engine else None,
    }


async def run_bench(args: argparse.Namespace, engine: EngineWorker | None = None) -> Report:
    """Everything `main` does but printing: discover models, warm up, run every level.
    With ``engine`` (``--compare-engine``) system B is that worker."""
    # A new connection per request, for every system alike (a loopback handshake costs
    # ~0.1 ms against seconds of generation): llama-server closes kept-alive connections
    # under the client, and reusing them failed half its requests ("Can not write
    # request body").
    connector = aiohttp.TCPConnector(
        limit=2 * max(args.levels) + 8, limit_per_host=0, force_close=True
    )
    context = args.prompt_words + args.max_tokens  # what a sequence holds at its last step
    ceilings: list[float] = []
    async with aiohttp.ClientSession(connector=connector) as session:
        cfg_a = LoadConfig(
            url=args.url,
            model=args.model or await fetch_model(session, args.url, args.api_key),
            api=args.api,
            prompt_words=args.prompt_words,
            seed=args.seed,
            max_tokens=args.max_tokens,
            ignore_eos=not args.no_ignore_eos,
            api_key=args.api_key,
            requests=args.requests,
            duration=args.duration,
            timeout=args.timeout,
            label=args.label_a,
        )
        cfg_b = None
        if args.compare:
            cfg_b = dataclasses.replace(
                cfg_a,
                url=args.compare,
                model=args.model_b or await fetch_model(session, args.compare, args.api_key),
                ignore_eos=cfg_a.ignore_eos and not args.no_ignore_eos_b,
                require_done=not args.no_done_b,
                label=args.label_b,
            )
        for cfg in (cfg_a, cfg_b):
            if cfg is not None:
                await _warm(session, cfg, args.warmup, args.levels)
        run_a = http_rounds(session, cfg_a)
        run_b: RunRound | None = None
        if cfg_b is not None:
            run_b = http_rounds(session, cfg_b)
        elif engine is not None:
            run_b = engine_rounds(engine, cfg_a, args.label_b)
            if args.engine_ceiling:
                run_b = _timing_the_ceiling(run_b, engine, max(args.levels), context, ceilings)
            if args.warmup > 0:
                warm = dataclasses.replace(cfg_a, requests=args.warmup)
                await engine_rounds(engine, warm, args.label_b)(
                    min(args.warmup, max(args.levels)), "warmup"
                )
        results: list[RunResult] = []
        comparisons: list[Comparison] = []
        for level in args.levels:
            if run_b is None:
                results.append(await run_level(session, cfg_a, level))
            else:
                labels = (args.label_a, args.label_b)
                comp = await compare_level(run_a, run_b, labels, level, args.rounds)
                comparisons.append(comp)
                results.extend((comp.a, comp.b))
    raw_step = _ceiling_summary(comparisons, max(args.levels), context, ceilings)
    config = {k: v for k, v in vars(args).items() if k not in {"api_key", "json", "concurrency"}}
    config.update(model=cfg_a.model, model_b=cfg_b.model if cfg_b else None)
    return Report(config, results, comparisons, raw_step)


def main(argv: list[str] | None = None) -> int:
    """Run the bench; exit 1 when any measured request failed, 2 when a server is unusable."""
    args = parse_args(argv)
    print_machine()
    # The engine worker starts first, so that it keeps the server's priority.
    engine = (
        EngineWorker(
            threads=args.engine_threads,
            dtype=args.engine_dtype,
            model_path=args.engine_model_path,
            max_running=max(64, *args.levels),
        )
        if args.compare_engine
        else None
    )
    if not args.no_nice:
        os.nice(10)  # client and server share 2 cores: let the server win
    try:
        report = asyncio.run(run_bench(args, engine))
    except (BenchError, EngineWorkerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if engine is not None:
            engine.close()
    print(format_results(report.results))
    if report.comparisons:
        print(format_ratios(report.comparisons))
    if report.raw_step:
        raw = report.raw_step
        print(
            f"raw batched decode step B={raw['batch']}: {raw['step_s'] * 1000:.0f} ms "
            f"= {raw['tok_s']:.0f} tok/s ceiling; engine-only at C={raw['batch']} ÷ ceiling "
            f"{_x(raw['engine_over_ceiling'])}"
        )
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(report.to_dict(), option=orjson.OPT_INDENT_2))
    return 1 if any(r.errors for r in report.results) else 0


if __name__ == "__main__":
    sys.exit(main())

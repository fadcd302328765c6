"""The engine with no HTTP: the ceiling the server is compared against.

``python -P -m sluice.bench.engine_only --concurrency 1,4,16,64`` drives the step
scheduler directly with the bench workload (≈64-word prompts, 64 greedy tokens,
``ignore_eos``), closed loop at each concurrency, and measures one raw batched
decode step (the model's forward at B=64 with a KV cache) for the ceiling.

``--worker`` keeps the model loaded and takes its work as JSON lines on stdin, one
answer line on stdout each, so that the load generator can run it in rounds
interleaved with the HTTP server's (``bench/engine_worker.py`` is that client):

    {"op": "run", "concurrency": C, "prompts": [text, …], "max_tokens": N}
        → {"wall_s": s, "records": [{"error", "latency_s", "ttft_s", "itl_s",
           "output_tokens"}, …]}
    {"op": "ceiling", "batch": B, "context": L} → the raw step (as ``raw_step_ceiling``)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sluice.bench.in_process import add_model_args, bench_model
from sluice.bench.load_client import make_prompt
from sluice.bench.machine import print_machine
from sluice.bench.stats import RequestRecord
from sluice.engine.assembly import ModelScheduler, build_scheduler
from sluice.engine.params import SamplingParams, SequenceSpec
from sluice.engine.scheduler import SchedulerConfig
from sluice.events.types import EngineEvent, SequenceFinished, TokenSampled


def _unused(events: Sequence[EngineEvent]) -> None:
    """No pipeline here: the bench counts events as the scheduler emits them."""


def drive(
    scheduler: ModelScheduler,
    prompts: list[tuple[int, ...]],
    concurrency: int,
    params: SamplingParams,
    tag: str = "bench",
    tokens: dict[int, list[int]] | None = None,
    records: list[RequestRecord] | None = None,
) -> tuple[float, int]:
    """Keep ``concurrency`` sequences in flight until every prompt is done; returns
    (seconds, generated tokens). Fills ``tokens`` (prompt index → its tokens) and
    ``records`` (one per request as it finishes: latency, TTFT and the gaps between its
    tokens, timed when the scheduler emits them) if given. A sequence that fails stops
    the bench."""
    queue = list(enumerate(prompts))
    in_flight = generated = 0
    # prompt index → (time added, times of its tokens so far, gaps between them)
    timing: dict[int, tuple[float, list[float], list[float]]] = {}

    def emit(sink: Any, event: EngineEvent) -> None:
        nonlocal in_flight, generated
        index = int(event.request_id.rsplit("-", 1)[1])
        if isinstance(event, TokenSampled):
            generated += 1
            if tokens is not None:
                tokens.setdefault(index, []).append(event.token_id)
            if records is not None:
                now = time.perf_counter()
                _, stamps, gaps = timing[index]
                if stamps:
                    gaps.append(now - stamps[-1])
                stamps.append(now)
        elif isinstance(event, SequenceFinished):
            if event.error is not None:
                raise RuntimeError(f"a bench sequence failed: {event.error}")
            in_flight -= 1
            if records is not None:
                added, stamps, gaps = timing.pop(index)
                records.append(
                    RequestRecord(
                        error=None,
                        latency_s=time.perf_counter() - added,
                        ttft_s=stamps[0] - added if stamps else None,
                        itl_s=gaps,
                        output_tokens=event.completion_tokens,
                    )
                )

    def top_up() -> None:
        nonlocal in_flight
        while queue and in_flight < concurrency:
            i, ids = queue.pop(0)
            if records is not None:
                timing[i] = (time.perf_counter(), [], [])
            # Events come back through ``emit``; the per-request sink is unused here.
            scheduler.add(SequenceSpec(f"{tag}-{concurrency}-{i}", 0, ids, params), _unused)
            in_flight += 1

    start = time.perf_counter()
    top_up()
    while scheduler.has_work:
        scheduler.step(emit)
        top_up()
    return time.perf_counter() - start, generated


def run_closed_loop(
    scheduler: ModelScheduler,
    prompts: list[tuple[int, ...]],
    concurrency: int,
    max_tokens: int,
) -> dict[str, float]:
    """Greedy, ``ignore_eos``, ``max_tokens`` each, at ``concurrency``."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    elapsed, generated = drive(scheduler, prompts, concurrency, params)
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "output_tokens": generated,
        "seconds": elapsed,
        "output_tok_s": generated / elapsed,
    }


@torch.inference_mode()
def raw_step_ceiling(
    scheduler: ModelScheduler, batch: int, context: int, repeats: int
) -> dict[str, float]:
    """Time one batched decode forward (decoder + LM head) over ``batch`` rows that each
    hold ``context`` cached positions: the most a step-batching engine could do."""
    cache = scheduler.cache
    if cache.slots < batch or cache.capacity < context + 1:
        cache.resize(max(cache.slots, batch), max(cache.capacity, context + 1))
    ids = torch.ones(batch, 1, dtype=torch.long)
    positions = torch.full((batch, 1), context, dtype=torch.long)
    times = []
    for _ in range(repeats + 1):
        begin = time.perf_counter()
        hidden = scheduler.runner.forward(slice(0, batch), ids, positions)
        scheduler.runner.head(hidden[:, -1]).argmax(dim=1).tolist()
        times.append(time.perf_counter() - begin)
    step = statistics.median(times[1:])
    return {"batch": batch, "context": context, "step_s": step, "tok_s": batch / step}


def serve_worker(scheduler: ModelScheduler, tokenizer: Any) -> int:
    """The ``--worker`` loop: one JSON request per stdin line, one JSON answer per line."""
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if request["op"] == "run":
            prompts = [tuple(tokenizer.encode(text)) for text in request["prompts"]]
            params = SamplingParams(
                max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True
            )
            records: list[RequestRecord] = []
            wall, _ = drive(scheduler, prompts, request["concurrency"], params, records=records)
            answer: dict[str, Any] = {
                "wall_s": wall,
                "records": [dataclasses.asdict(r) for r in records],
            }
        elif request["op"] == "ceiling":
            answer = raw_step_ceiling(scheduler, request["batch"], request["context"], 5)
        else:
            answer = {"error": f"unknown op {request['op']!r}"}
        print(json.dumps(answer), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="engine_only", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--requests", type=int, help="per level (default 4×C, at least 8: as loadgen)")
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-running", type=int, default=64, help="as the server's default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument("--worker", action="store_true", help="take work as JSON lines on stdin")
    args = p.parse_args(argv)
    if not args.worker:  # its stdout is the JSON-lines protocol
        print_machine()
    loaded = bench_model(args)
    tokenizer, model = loaded.tokenizer, loaded.load()
    levels = [int(c) for c in args.concurrency.split(",")]
    scheduler = build_scheduler(
        model,
        SchedulerConfig(max_running=max(args.max_running, *levels), context_length=8192),
        eos_token_ids=frozenset({tokenizer.eos_token_id}),
        device=torch.device("cpu"),
    )
    if args.worker:
        return serve_worker(scheduler, tokenizer)
    import random

    rng = random.Random(args.seed)
    results = []
    for c in levels:
        n = args.requests or max(4 * c, 8)
        prompts = [tuple(tokenizer.encode(make_prompt(rng, args.prompt_words))) for _ in range(n)]
        results.append(run_closed_loop(scheduler, prompts, c, args.max_tokens))
        r = results[-1]
        print(
            f"engine-only C={c:<3} {r['output_tok_s']:8.1f} output tok/s ({r['requests']} requests)"
        )
    ceiling = raw_step_ceiling(scheduler, max(levels), args.prompt_words + args.max_tokens, 5)
    print(
        f"raw batched decode step B={ceiling['batch']}: {ceiling['step_s'] * 1000:.0f} ms "
        f"= {ceiling['tok_s']:.0f} tok/s ceiling"
    )
    if args.json:
        args.json.write_text(json.dumps({"engine_only": results, "raw_step": ceiling}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

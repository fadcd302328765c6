"""The CPU's decode step compiled by inductor (``--enable-torch-compile``) against the
eager step the server runs by default.

``python -P -m sluice.bench.compiled_step`` loads the model as the server does (the
GGUF's own weights packed, ``--dtype auto``), builds two step schedulers over the same
weights, one eager and one compiling every batch bucket up to ``--max-bs``, and prints:

- the compile time of each bucket (inductor's cache under ``models/cache/inductor``
  makes a later start's much shorter: run it twice to see both);
- the bench workload (≈64-word prompts, 64 greedy tokens, ``ignore_eos``, closed loop
  at each of ``--concurrency``) through both schedulers, interleaved A B, with output
  tok/s, the ratio, and whether both gave the same tokens;
- then one raw decode step (decoder and LM head) at each batch size, eager and
  compiled, interleaved over ``--rounds`` rounds, and their ratio (a batch above the
  compiled buckets steps eagerly in both).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from sluice.bench.engine_only import drive
from sluice.bench.in_process import add_model_args, bench_model
from sluice.bench.load_client import make_prompt
from sluice.bench.machine import print_machine
from sluice.engine.assembly import ModelScheduler, build_scheduler
from sluice.engine.compiled_step import use_cache_dir
from sluice.engine.loader import default_models_dir
from sluice.engine.params import SamplingParams
from sluice.engine.scheduler import SchedulerConfig


def _step_seconds(scheduler: ModelScheduler, batch: int, context: int, repeats: int) -> float:
    """Median seconds of one decode step of ``batch`` rows at ``context`` cached
    positions: through the compiled fixed-shape step where the scheduler has one, else
    the plain forward the server runs."""
    cache, runner = scheduler.cache, scheduler.runner
    if cache.slots < batch or cache.capacity < context + 1:
        cache.resize(max(cache.slots, batch), max(cache.capacity, context + 1))
    tokens, positions = [1] * batch, [context] * batch
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            begin = time.perf_counter()
            logits = runner.static.run(tokens, positions) if runner.static else None
            if logits is None:
                ids = torch.ones(batch, 1, dtype=torch.long)
                at = torch.full((batch, 1), context, dtype=torch.long)
                logits = runner.head(runner.forward(slice(0, batch), ids, at)[:, -1])
            logits.argmax(dim=-1).tolist()
            times.append(time.perf_counter() - begin)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="compiled_step", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--max-bs", type=int, default=8, help="as --torch-compile-max-bs")
    p.add_argument("--batches", default="1,2,4,8,16")
    p.add_argument("--context", type=int, default=128, help="cached positions of a raw step")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print_machine()
    use_cache_dir(default_models_dir() / "cache" / "inductor")
    loaded = bench_model(args)
    model = loaded.load()
    levels = [int(c) for c in args.concurrency.split(",")]

    def scheduler(compiled: bool) -> ModelScheduler:
        config = SchedulerConfig(
            max_running=max(16, *levels),
            context_length=8192,
            fixed_shape_decode=compiled,
            graph_max_batch=args.max_bs,
            compile_decode=compiled,
        )
        eos = frozenset({loaded.tokenizer.eos_token_id})
        return build_scheduler(model, config, eos_token_ids=eos, device=torch.device("cpu"))

    begin = time.perf_counter()
    schedulers = {"eager": scheduler(False), "compiled": scheduler(True)}
    print(f"built both schedulers (compiling every bucket) in {time.perf_counter() - begin:.0f} s")

    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    print("\nworkload (output tok/s, interleaved A B):")
    print("| C | eager tok/s | compiled tok/s | ÷ (per round) | same tokens |")
    print("|---|---|---|---|---|")
    for c in levels:
        texts = [make_prompt(rng, 64) for _ in range(max(8, 4 * c))]
        prompts = [tuple(loaded.tokenizer.encode(text)) for text in texts]
        rates: dict[str, list[float]] = {"eager": [], "compiled": []}
        tokens: dict[str, dict[int, list[int]]] = {}
        for _ in range(args.rounds):
            for name, sch in schedulers.items():
                got: dict[int, list[int]] = {}
                seconds, generated = drive(sch, prompts, c, params, tokens=got)
                rates[name].append(generated / seconds)
                tokens[name] = got
        ratios = [b / a for a, b in zip(rates["eager"], rates["compiled"], strict=True)]
        same = sum(tokens["eager"][i] == tokens["compiled"][i] for i in tokens["eager"])
        print(
            f"| {c} | {statistics.median(rates['eager']):.1f} | "
            f"{statistics.median(rates['compiled']):.1f} | "
            f"**{statistics.median(ratios):.2f}** ({', '.join(f'{r:.2f}' for r in ratios)}) | "
            f"{same}/{len(prompts)} |"
        )
    print("\nraw decode step (decoder + LM head), ms, medians of 10, interleaved rounds:")
    print("| B | eager ms | compiled ms | eager ÷ compiled |\n|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        ms: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.rounds):
            for name, sch in schedulers.items():
                ms[name].append(_step_seconds(sch, batch, args.context, 10) * 1e3)
        eager, compiled = min(ms["eager"]), min(ms["compiled"])
        print(f"| {batch} | {eager:.1f} | {compiled:.1f} | **{eager / compiled:.2f}** |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

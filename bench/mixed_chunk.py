"""Mixed steps against separate prefill and decode forwards, in the engine alone.

One model, one scheduler per configuration, rounds interleaved A B A B on the same
prompts (the README's workload: ≈64-word prompts, 64 greedy tokens, ``ignore_eos``,
closed loop). Prints each configuration's output tok/s, TTFT and ITL percentiles,
and its ratios to the baseline (the first configuration), pooled over the rounds:

    python -P -m sluice.bench.mixed_chunk --concurrency 16 --rounds 3 \\
        --configs separate:512,mixed:512,mixed:128 [--isa avx512]

Then, with C sequences decoding in each scheduler, it times a decode-only step and a
step in which one prompt arrives, configurations interleaved (``--step-repeats``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from sluice.bench.emulated_isa import add_isa_argument, emulate
from sluice.bench.engine_only import drive
from sluice.bench.in_process import add_model_args, bench_model
from sluice.bench.load_client import make_prompt
from sluice.bench.machine import print_machine
from sluice.bench.stats import RequestRecord, RunResult, compare_results, pool, summarise
from sluice.engine.assembly import ModelScheduler, build_scheduler
from sluice.engine.params import SamplingParams, SequenceSpec
from sluice.engine.scheduler import SchedulerConfig


def parse_configs(text: str) -> list[tuple[str, bool, int]]:
    """``separate:512,mixed:128`` → [(label, mixed, prefill budget), …]."""
    configs = []
    for item in text.split(","):
        kind, _, budget = item.partition(":")
        if kind not in ("separate", "mixed") or not budget.isdigit():
            raise SystemExit(f"bad config {item!r}: use separate:N or mixed:N")
        configs.append((item, kind == "mixed", int(budget)))
    return configs


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def step_costs(
    schedulers: dict[str, ModelScheduler], prompts: list[tuple[int, ...]], rows: int, repeats: int
) -> dict[str, tuple[float, float]]:
    """Median ms of a decode-only step and of a step in which one prompt arrives, with
    ``rows`` sequences decoding, per configuration (interleaved per repeat)."""
    running = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    once = SamplingParams(max_tokens=1, temperature=0.0)
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in schedulers}
    for scheduler in schedulers.values():
        for i in range(rows):
            scheduler.add(SequenceSpec(f"cost-{i}", 0, prompts[i], running), _discard)
        for _ in range(3):
            scheduler.step(_ignore)
    for k in range(repeats):
        for label, scheduler in schedulers.items():
            decode, arriving = times[label]
            begin = time.perf_counter()
            scheduler.step(_ignore)
            decode.append(time.perf_counter() - begin)
            new = prompts[(rows + k) % len(prompts)]
            scheduler.add(SequenceSpec(f"cost-new-{k}", 0, new, once), _discard)
            begin = time.perf_counter()
            scheduler.step(_ignore)
            arriving.append(time.perf_counter() - begin)
    return {
        label: (statistics.median(d) * 1000, statistics.median(a) * 1000)
        for label, (d, a) in times.items()
    }


def _ignore(sink: object, event: object) -> None:
    """Step costs count time, not events."""


def _discard(events: object) -> None:
    """The per-request sink: unused, events go to the step's emit."""


def interleaved_rounds(
    schedulers: dict[str, ModelScheduler],
    prompt_rounds: list[list[tuple[int, ...]]],
    concurrency: int,
    params: SamplingParams,
) -> tuple[dict[str, list[RunResult]], dict[str, dict[int, list[int]]]]:
    """Each round's prompts through every scheduler in turn (A B A B), closed loop:
    per configuration its rounds' results and its round-1 outputs."""
    runs: dict[str, list[RunResult]] = {label: [] for label in schedulers}
    outputs: dict[str, dict[int, list[int]]] = {}
    for round_no, prompts in enumerate(prompt_rounds):
        for label, scheduler in schedulers.items():
            records: list[RequestRecord] = []
            tokens: dict[int, list[int]] = {}
            seconds, _ = drive(scheduler, prompts, concurrency, params, label, tokens, records)
            runs[label].append(summarise(records, seconds, label=label, concurrency=concurrency))
            if round_no == 0:
                outputs[label] = tokens
            r = runs[label][-1]
            print(f"round {round_no + 1} {label:14s} {r.output_tok_per_s:7.1f} tok/s")
    return runs, outputs


def summarise_rounds(
    baseline_label: str,
    runs: dict[str, list[RunResult]],
    outputs: dict[str, dict[int, list[int]]],
) -> list[dict[str, object]]:
    """Print each configuration's pooled numbers and ratios to the baseline."""
    # In 16-bit types the GEMM's rounding depends on the batch's shape, so a greedy
    # near-tie can fall the other way; in float32 every configuration agrees (tests).
    for label, out in outputs.items():
        differ = sum(out[i] != outputs[baseline_label][i] for i in out)
        print(f"{label}: {differ} of {len(out)} round-1 outputs differ from {baseline_label}")
    pooled = {label: pool(results, label=label) for label, results in runs.items()}
    base = pooled[baseline_label]
    print(
        f"{'config':14s} {'tok/s':>7s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
        f"{'ITL p50':>8s} {'ITL p99':>8s}  ratios to {baseline_label}: tok/s, TTFT p99, ITL p99"
    )
    report: list[dict[str, object]] = []
    for label, result in pooled.items():
        ttft, itl = result.ttft, result.itl
        assert ttft is not None and itl is not None
        ratios = compare_results(result, base)
        print(
            f"{label:14s} {result.output_tok_per_s:7.1f} {ttft.p50 * 1000:7.0f}ms "
            f"{ttft.p99 * 1000:7.0f}ms {itl.p50 * 1000:6.0f}ms {itl.p99 * 1000:6.0f}ms  "
            + " ".join(_fmt(ratios[key]) for key in ("output_tok_per_s", "ttft_p99", "itl_p99"))
        )
        report.append({"config": label, **result.to_dict(), "ratios": ratios})
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, help="per round (default 4×C)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", default="separate:512,mixed:512,mixed:256,mixed:128")
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--step-repeats", type=int, default=6, help="0: skip the step costs")
    p.add_argument("--json", type=Path)
    add_isa_argument(p)
    args = p.parse_args(argv)
    emulate(args.isa, "sluice.bench.mixed_chunk")
    print_machine()
    configs = parse_configs(args.configs)
    loaded = bench_model(args)
    tokenizer, model, folder, dtype = loaded.tokenizer, loaded.load(), loaded.folder, loaded.dtype
    c = args.concurrency
    schedulers = {
        label: build_scheduler(
            model,
            SchedulerConfig(
                # One slot more than C: the step costs admit a prompt beside C decoding rows.
                max_running=max(64, c + 1),
                context_length=8192,
                prefill_chunk=budget,
                mixed_chunk=mixed,
            ),
            eos_token_ids=frozenset({tokenizer.eos_token_id}),
            device=torch.device("cpu"),
        )
        for label, mixed, budget in configs
    }
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    n = args.requests or 4 * c
    print(f"model {folder.name} dtype {dtype} threads {args.threads} C={c} {n} requests/round")
    prompt_rounds = [
        [tuple(tokenizer.encode(make_prompt(rng, args.prompt_words))) for _ in range(n)]
        for _ in range(args.rounds)
    ]
    runs, outputs = interleaved_rounds(schedulers, prompt_rounds, c, params)
    report = summarise_rounds(configs[0][0], runs, outputs) if args.rounds else []
    costs: dict[str, tuple[float, float]] = {}
    if args.step_repeats:
        prompts = [
            tuple(tokenizer.encode(make_prompt(rng, args.prompt_words))) for _ in range(c + 8)
        ]
        costs = step_costs(schedulers, prompts, c, args.step_repeats)
        for label, (decode_ms, arriving_ms) in costs.items():
            print(
                f"{label:14s} step with {c} decoding: {decode_ms:.0f} ms; "
                f"with one prompt arriving too: {arriving_ms:.0f} ms"
            )
    if args.json:
        body = {"concurrency": c, "runs": report, "step_ms": costs}
        args.json.write_text(json.dumps(body, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

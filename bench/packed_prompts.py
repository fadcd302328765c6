"""Prompt chunks multiplied packed or dense, in a served workload: what the packed-row
limits measured to 1024 rows (``engine/packed_rows.py``) change.

    python -P -m sluice.bench.packed_prompts [--model-path X.gguf] [--concurrency 64]
        [--rounds 2] [--cap 64] [--isa native|avx512|avx2]

Loads the model as the server does (its limits measured, or read where kept), and
drives its scheduler in-process with the bench workload (≈64-word prompts, 64 greedy
tokens with ``ignore_eos``, closed loop, 2×C requests a round), alternating round by
round between the measured limits and the same limits capped at ``--cap`` rows (64:
the most measured before 2026-12-05, when every prompt chunk multiplied the
de-quantised weight). The first round of each is a warm-up. Prints the machine line,
the limits, each round's output tok/s and TTFT p50 both ways, the ratio, and how many
greedy outputs the two gave alike (the packed kernel quantises a prompt's activations
to int8, as decoding's rows; the dense weight multiplies them in ``--dtype``).
``--isa`` runs as on a CPU with less (``bench/emulated_isa.py``).

Only steps of more than ``--cap`` rows differ between the two: the C++ decode step
(``engine/direct_decode.py``) keeps the limits it was built with, so the concurrency
must not exceed ``--cap``, and its decode steps multiply alike both ways.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

import torch

from sluice.bench.emulated_isa import add_isa_argument, emulate
from sluice.bench.engine_only import drive
from sluice.bench.in_process import add_model_args, bench_model
from sluice.bench.load_client import make_prompt
from sluice.bench.machine import print_machine
from sluice.bench.stats import RequestRecord
from sluice.engine.assembly import build_scheduler
from sluice.engine.gguf_packed import packed_projections
from sluice.engine.params import SamplingParams
from sluice.engine.scheduler import SchedulerConfig

MEASURED, CAPPED = "measured", "capped"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="packed_prompts", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cap", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    add_isa_argument(p)
    args = p.parse_args(argv)
    if args.concurrency > args.cap:
        p.error("--concurrency must not exceed --cap: decode steps keep their built limits")
    emulate(args.isa, "sluice.bench.packed_prompts")
    print("command: python -P -m sluice.bench.packed_prompts", *(argv or sys.argv[1:]))
    print_machine()
    loaded = bench_model(args)
    model = loaded.load()
    projections = packed_projections(model)
    if not projections:
        p.error("the model serves no packed projection (not a quantised GGUF?)")
    limits = {
        MEASURED: [q.max_rows for q in projections],
        CAPPED: [min(q.max_rows, args.cap) for q in projections],
    }
    said = sorted({("x".join(map(str, q.shape)), q.max_rows) for q in projections})
    print("packed-row limits measured:", ", ".join(f"{shape}: {rows}" for shape, rows in said))
    tokenizer = loaded.tokenizer
    c = args.concurrency
    scheduler = build_scheduler(
        model,
        SchedulerConfig(max_running=c, context_length=8192),
        eos_token_ids=frozenset({tokenizer.eos_token_id}),
        device=torch.device("cpu"),
    )
    rng = random.Random(0)
    prompts = [tuple(tokenizer.encode(make_prompt(rng, args.prompt_words))) for _ in range(2 * c)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rates: dict[str, list[float]] = {MEASURED: [], CAPPED: []}
    outputs: dict[str, dict[int, list[int]]] = {}
    for round_ in range(args.rounds + 1):
        for name in (CAPPED, MEASURED):
            for projection, rows in zip(projections, limits[name], strict=True):
                projection.max_rows = rows
            records: list[RequestRecord] = []
            outputs[name] = {}
            wall, generated = drive(
                scheduler, prompts, c, params, f"{name}{round_}", outputs[name], records
            )
            if not round_:
                continue  # the warm-up
            rates[name].append(generated / wall)
            ttft = statistics.median(r.ttft_s for r in records if r.ttft_s is not None)
            print(f"round {round_} {name:>8}: {generated / wall:7.1f} tok/s, "
                  f"TTFT p50 {ttft * 1e3:5.0f} ms", flush=True)  # fmt: skip
    ratios = [a / b for a, b in zip(rates[MEASURED], rates[CAPPED], strict=True)]
    print(f"measured ÷ capped at {args.cap} rows: tok/s ×{statistics.mean(ratios):.2f} "
          f"(rounds {', '.join(f'{r:.2f}' for r in ratios)})")  # fmt: skip
    alike = sum(outputs[MEASURED][i] == outputs[CAPPED][i] for i in outputs[MEASURED])
    print(f"greedy outputs alike: {alike}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

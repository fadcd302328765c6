"""A kept packed-row decision against this build's fresh measurement, in whole decode
steps, as ratios.

    python -P -m sluice.bench.packed_rows --kept models/cache/precision/packed-rows-v2-….json \
        [--model-path X.gguf] [--rounds 15]

Loads the model packed as the server does, measures each projection shape's limit as
this build measures it (``engine/packed_rows.py``), then times one decode step (the
forward and the LM head, 128 cached positions) at 1, 2, 4, 8 and 16 rows with the
kept limits and with the fresh ones, alternating step by step (medians after a warm-up
round). A decision measured by an earlier build of the measurement is kept under an
older name (``packed-rows-v2-…``), so the two can be set side by side on one machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import orjson
import torch

from sluice.bench.in_process import add_model_args, bench_model
from sluice.bench.machine import print_machine
from sluice.bench.quantization import step_seconds
from sluice.engine.assembly import build_scheduler
from sluice.engine.gguf_packed import Int4Projections, packed_projections
from sluice.engine.packed_rows import Shape, apply_limits, head_shape, measure_limits
from sluice.engine.scheduler import SchedulerConfig

ROWS = (1, 2, 4, 8, 16)


def said(limits: dict[Shape, int]) -> str:
    return ", ".join(f"{'x'.join(map(str, s))}: {rows}" for s, rows in sorted(limits.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="packed_rows", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--kept", type=Path, required=True, help="a kept decision's JSON file")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    print("command: python -P -m sluice.bench.packed_rows", *(argv or sys.argv[1:]))
    print_machine()
    model = bench_model(args).load()
    by_shape: dict[Shape, Int4Projections] = {}
    for projection in packed_projections(model):
        by_shape.setdefault(projection.shape, projection)
    kept = {
        (e["out"], e["in"], e["planes"]): e["max_rows"]
        for e in orjson.loads(args.kept.read_bytes())
    }
    if set(kept) != set(by_shape):
        p.error(f"{args.kept.name} holds other shapes than this model's: {said(kept)}")
    fresh = measure_limits(by_shape, head=head_shape(model))
    print(f"kept ({args.kept.name}): {said(kept)}")
    print(f"measured now: {said(fresh)}")
    scheduler = build_scheduler(
        model,
        SchedulerConfig(max_running=max(ROWS), context_length=8192),
        eos_token_ids=frozenset(),
        device=torch.device("cpu"),
    )
    cache = scheduler.cache
    cache.resize(max(cache.slots, max(ROWS)), max(cache.capacity, 512))
    times: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds + 1):  # the first round warms up and is dropped
        for rows in ROWS:
            for name, limits in (("kept", kept), ("now", fresh)):
                apply_limits(model, limits)
                seconds = step_seconds(scheduler, rows, 0)
                if round_:
                    times.setdefault((name, rows), []).append(seconds)
    for rows in ROWS:
        before = statistics.median(times["kept", rows])
        now = statistics.median(times["now", rows])
        print(
            f"decode step {rows:2} rows: kept limits {before * 1000:6.1f} ms, measured now "
            f"{now * 1000:6.1f} ms, speed-up ×{before / now:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

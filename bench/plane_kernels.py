"""Sluice's own packed GEMM against torch's, on a real model: quality and speed as ratios.

    python -P -m sluice.bench.plane_kernels [--model-path …] [--rows 1,4,16,64] [--rounds 5]

Loads the model twice in one process, both times serving the GGUF's own blocks packed
(``--quantization gguf``): once multiplied by Sluice's ``planes_mm`` (int8 activations,
integer dot products) and once by torch's ``_weight_int4pack_mm_for_cpu`` (bfloat16
activations), every forward packed whatever its rows (no switch to the de-quantised
weight), and prints, after the machine line:

- perplexity on the public-domain text (one token a forward, as decode multiplies) and
  how many greedy tokens of prompts cut from it the two agree on;
- one decode step (128 cached positions) at each row count and one 512-token prefill
  chunk, the two models interleaved round by round: ms each and torch's ÷ own's.

``--isa avx2`` runs both as on a CPU with AVX2 alone (no AVX-512, no bf16 arithmetic),
``--isa avx512`` as on one without AMX (``bench/emulated_isa.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch

from sluice.bench.emulated_isa import add_isa_argument, emulate
from sluice.bench.in_process import add_model_args, bench_model
from sluice.bench.machine import print_machine
from sluice.bench.perplexity import TEXT
from sluice.bench.quantization import PROMPT_TOKENS, agreement, greedy, perplexity, step_seconds
from sluice.engine.assembly import build_scheduler
from sluice.engine.gguf_packed import pack_model, packed_projections
from sluice.engine.native_kernels import planes_kernel
from sluice.engine.plane_kernels import KERNELS
from sluice.engine.quantization import NONE
from sluice.engine.scheduler import SchedulerConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="plane_kernels", description=__doc__.split("\n\n")[0])
    add_model_args(p, quantization=NONE)
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens (0: none)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    add_isa_argument(p)
    args = p.parse_args(argv)
    emulate(args.isa, "sluice.bench.plane_kernels")
    print_machine()
    unavailable = planes_kernel()
    if unavailable is not None:
        print(f"Sluice's kernel is not built here: {unavailable}", file=sys.stderr)
        return 1
    loaded = bench_model(args)
    models: dict[str, Any] = {}
    for name, kernel in KERNELS.items():
        model = loaded.load(NONE)
        pack_model(model, loaded.folder, loaded.source, kernel)
        for projection in packed_projections(model):
            projection.max_rows = 1 << 30  # the kernel at every row count
        models[name] = model
    print(f"model {loaded.folder.name}, {loaded.dtype} around the packed GEMMs, "
          f"{args.threads} threads")  # fmt: skip

    ids = loaded.tokenizer.encode(TEXT.read_text())
    ppl = {name: perplexity(model, ids) for name, model in models.items()}
    print(f"perplexity on {TEXT.name} ({len(ids)} tokens): own {ppl['own']:.3f}, "
          f"torch {ppl['torch']:.3f} (own ÷ torch ×{ppl['own'] / ppl['torch']:.3f})")  # fmt: skip
    stride = (len(ids) - PROMPT_TOKENS) // args.prompts
    prompts = [ids[i * stride : i * stride + PROMPT_TOKENS] for i in range(args.prompts)]
    agreed = [
        agreement(*(greedy(models[name], prompt, args.new_tokens) for name in KERNELS))
        for prompt in prompts
    ]
    print(f"greedy agreement own vs torch over {args.prompts} prompts: "
          f"{sum(a == args.new_tokens for a in agreed)}/{args.prompts} identical for "
          f"{args.new_tokens} tokens, median {statistics.median(agreed):.0f}")  # fmt: skip

    rows = [int(r) for r in args.rows.split(",")]
    schedulers = {
        name: build_scheduler(
            model,
            SchedulerConfig(max_running=max(rows), context_length=8192),
            eos_token_ids=frozenset({loaded.tokenizer.eos_token_id}),
            device=torch.device("cpu"),
        )
        for name, model in models.items()
    }
    for scheduler in schedulers.values():
        scheduler.cache.resize(max(scheduler.cache.slots, max(rows)), max(512, args.chunk))
    shapes = [(r, 0) for r in rows] + ([(1, args.chunk)] if args.chunk else [])
    times: dict[tuple[str, int, int], list[float]] = {}
    for _ in range(args.rounds + 1):  # the first round warms up and is dropped
        for r, chunk in shapes:
            for name, scheduler in schedulers.items():
                times.setdefault((name, r, chunk), []).append(step_seconds(scheduler, r, chunk))
    for r, chunk in shapes:
        own, theirs = (statistics.median(times[name, r, chunk][1:]) for name in KERNELS)
        what = f"prefill chunk {chunk} tokens" if chunk else f"decode step {r:>2} rows"
        print(f"{what}: own {own * 1000:7.1f} ms, torch {theirs * 1000:7.1f} ms, "
              f"torch ÷ own ×{theirs / own:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

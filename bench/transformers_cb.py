"""transformers' own continuous batching (``generate_batch``, paged KV cache) against
Sluice's step scheduler: the measurement behind the engine decision in
docs/architecture.md.

``python -P -m sluice.bench.transformers_cb`` runs the same requests (≈64-word
prompts, 64 greedy tokens each, all in flight at once) through both, interleaved
A B A B, and prints output tok/s and the ratio per round.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

import torch

from sluice.bench.engine_only import run_closed_loop
from sluice.bench.load_client import make_prompt
from sluice.engine.assembly import build_scheduler
from sluice.engine.loader import load_causal_lm, load_tokenizer, resolve_model
from sluice.engine.scheduler import SchedulerConfig


def generate_batch_tok_s(model: Any, prompts: list[tuple[int, ...]], max_tokens: int) -> float:
    from transformers import GenerationConfig

    # eos_token_id=-1: never stop early, as ``ignore_eos`` does for Sluice.
    config = GenerationConfig(
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=0,
    )
    start = time.perf_counter()
    out = model.generate_batch(
        inputs=[list(p) for p in prompts], generation_config=config, progress_bar=False
    )
    elapsed = time.perf_counter() - start
    return sum(len(o.generated_tokens) for o in out.values()) / elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="transformers_cb", description=__doc__)
    p.add_argument("--model-path")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    folder = resolve_model(args.model_path).folder
    tokenizer = load_tokenizer(folder)
    rng = random.Random(0)
    prompts = [tuple(tokenizer.encode(make_prompt(rng, 64))) for _ in range(args.requests)]
    scheduler = build_scheduler(
        load_causal_lm(folder, dtype="float32", device="cpu"),
        SchedulerConfig(max_running=args.requests, context_length=8192),
        eos_token_ids=frozenset({tokenizer.eos_token_id}),
        device=torch.device("cpu"),
    )
    paged = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="paged|sdpa"
    )
    for round_ in range(args.rounds):
        theirs = generate_batch_tok_s(paged, prompts, args.max_tokens)
        ours = run_closed_loop(scheduler, prompts, args.requests, args.max_tokens)["output_tok_s"]
        print(
            f"round {round_}: generate_batch {theirs:6.1f} tok/s   sluice {ours:6.1f} tok/s"
            f"   sluice ÷ generate_batch {ours / theirs:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

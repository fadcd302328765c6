"""The engine on a GPU: decode steps replayed from CUDA graphs against eager ones.

``python -P -m sluice.bench.cuda_graphs --concurrency 1,4,16,64`` loads the model
once on CUDA and runs the bench workload (≈64-word prompts, 64 greedy tokens,
``ignore_eos``, closed loop at concurrency C) through two step schedulers, one
stepping eagerly and one replaying captured decode steps, interleaved A B A B over
``--rounds`` rounds with the same prompts for both. It checks that both produce the
same tokens for every request, prints output tok/s and the ratio per level, and
times one raw decode step (decoder + LM head) both ways at each batch size.

``--random-weights`` initialises the model from its config.json (seeded) instead of
loading weights: for a machine the weights cannot reach. Speed does not depend on
the values, and eager and replayed steps are still compared token for token.
``--device cpu`` smoke-tests this program without a GPU: the fixed-shape step then
runs eagerly, so its ratios mean nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from sluice.bench.engine_only import drive
from sluice.bench.load_client import make_prompt
from sluice.bench.machine import print_machine
from sluice.engine.assembly import ModelScheduler, build_scheduler
from sluice.engine.cuda_graphs import StaticDecode
from sluice.engine.loader import load_causal_lm, load_tokenizer, resolve_model
from sluice.engine.params import SamplingParams
from sluice.engine.scheduler import SchedulerConfig

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_model(folder: Path, dtype: str, random_weights: bool, seed: int, device: str) -> Any:
    if not random_weights:
        return load_causal_lm(folder, dtype=dtype, device=device)
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_config(
        config, dtype=_DTYPES[dtype], attn_implementation="sdpa"
    )
    return model.to(device).eval()


def raw_step(
    scheduler: ModelScheduler, batch: int, context: int, repeats: int, graphs: bool
) -> float:
    """Median seconds of one decode step over ``batch`` rows at ``context`` positions."""
    cache = scheduler.cache
    if cache.slots < batch or cache.capacity < context + 1:
        cache.resize(max(cache.slots, batch), max(cache.capacity, context + 1))
    static = StaticDecode(scheduler.runner, max_batch=batch, capture=graphs)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            begin = time.perf_counter()
            logits = static.run([1] * batch, [context] * batch)
            assert logits is not None
            logits.argmax(dim=1).tolist()
            times.append(time.perf_counter() - begin)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cuda_graphs", description=__doc__)
    p.add_argument("--model-path")
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, help="per level and round (default 4×C, at least 8)")
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    print_machine()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("cuda_graphs: no CUDA device (--device cpu smoke-tests it)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    folder = resolve_model(args.model_path).folder
    tokenizer = load_tokenizer(folder)
    model = load_model(folder, args.dtype, args.random_weights, args.seed, args.device)
    levels = [int(c) for c in args.concurrency.split(",")]

    def scheduler(fixed_shape: bool) -> ModelScheduler:
        config = SchedulerConfig(
            max_running=max(levels), context_length=8192, fixed_shape_decode=fixed_shape
        )
        return build_scheduler(model, config, eos_token_ids=frozenset(), device=device)

    eager, graphs = scheduler(False), scheduler(True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(args.seed)
    print(f"device: {device_name}, torch {torch.__version__}, {args.dtype}")
    levels_out = []
    for c in levels:
        rates: dict[str, list[float]] = {"eager": [], "graphs": []}
        mismatched = 0
        for r in range(args.rounds):
            n = args.requests or max(4 * c, 8)
            prompts = [
                tuple(tokenizer.encode(make_prompt(rng, args.prompt_words))) for _ in range(n)
            ]
            outputs: dict[str, dict[int, list[int]]] = {}
            for name, sch in (("eager", eager), ("graphs", graphs)):
                outputs[name] = {}
                if device.type == "cuda":
                    torch.cuda.synchronize()
                seconds, generated = drive(sch, prompts, c, params, f"{name}{r}", outputs[name])
                rates[name].append(generated / seconds)
            mismatched += sum(
                outputs["eager"][i] != outputs["graphs"][i] for i in range(len(prompts))
            )
        eager_rate = statistics.median(rates["eager"])
        graph_rate = statistics.median(rates["graphs"])
        levels_out.append(
            {
                "concurrency": c,
                "eager_tok_s": eager_rate,
                "graphs_tok_s": graph_rate,
                "ratio": graph_rate / eager_rate,
                "rounds_eager": rates["eager"],
                "rounds_graphs": rates["graphs"],
                "requests_with_different_tokens": mismatched,
            }
        )
        print(
            f"C={c:<3} eager {eager_rate:8.1f} tok/s  graphs {graph_rate:8.1f} tok/s  "
            f"graphs ÷ eager {graph_rate / eager_rate:5.2f}  "
            f"requests with different tokens: {mismatched}"
        )
    context = args.prompt_words + args.max_tokens
    steps = []
    for batch in levels:
        eager_s = raw_step(eager, batch, context, 20, graphs=False)
        graph_s = raw_step(graphs, batch, context, 20, graphs=device.type == "cuda")
        steps.append(
            {"batch": batch, "context": context, "eager_step_s": eager_s, "graph_step_s": graph_s}
        )
        print(
            f"raw decode step B={batch:<3} eager {eager_s * 1e3:7.2f} ms  "
            f"replayed {graph_s * 1e3:7.2f} ms  ({batch / graph_s:8.0f} tok/s ceiling)"
        )
    print(f"graphs captured by the serving scheduler: {graphs.runner.static.captures}")  # type: ignore[union-attr]
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": device_name,
                    "torch": torch.__version__,
                    "dtype": args.dtype,
                    "random_weights": args.random_weights,
                    "levels": levels_out,
                    "raw_step": steps,
                },
                indent=2,
            )
        )
    return 1 if any(level["requests_with_different_tokens"] for level in levels_out) else 0


if __name__ == "__main__":
    sys.exit(main())

"""What a ``--quantization`` method costs in quality and gains in speed, as ratios.

``python -P -m sluice.bench.quantization [--method gguf|w8a8_int8]`` loads the model
twice in one process, de-quantised (``--quantization none``, in ``--dtype``) and with
the method applied (``gguf``, the default: the file's own blocks, packed; ``w8a8_int8``:
int8 weights and activations), and prints:

- quality: perplexity on a fixed public-domain text (``bench/data/public_domain.txt``,
  the Declaration of Independence and the Gettysburg Address), and greedy agreement
  with the unquantised model: for prompts cut from that text, how many of
  ``--new-tokens`` greedy tokens match before the first difference;
- for ``gguf``, what re-quantising a type costs on its own (Q6_K, whose scales are
  finer than the kernel's groups): the de-quantised model's perplexity and greedy
  agreement with only those weights replaced by the re-quantised ones, everything
  else as before (the packed model runs them dense where this machine's row limits
  say so, so its own figures need not show it);
- batch agreement: the same prompts decoded alone and sixteen at a time through the
  step scheduler, the share of prompts whose greedy tokens are identical (per model);
- speed: one decode step at 1, 4, 16 and 64 rows (128 cached positions) and one
  512-token prefill chunk, both models interleaved round by round, the method ÷ unquantised.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from sluice.bench.engine_only import drive
from sluice.bench.in_process import BenchModel, add_model_args, bench_model
from sluice.bench.machine import print_machine
from sluice.bench.perplexity import TEXT, next_token_logprobs
from sluice.engine.assembly import ModelScheduler, build_scheduler
from sluice.engine.params import SamplingParams
from sluice.engine.quantization import GGUF, NONE, QUANTIZATION_METHODS
from sluice.engine.scheduler import SchedulerConfig

PROMPT_TOKENS = 48


def perplexity(model: Any, ids: list[int]) -> float:
    """Over the whole text, a packed model fed one token a forward: its kernel does the
    multiplying, as when it decodes (one forward of the whole text would take the
    de-quantised weight kept for large forwards)."""
    logprobs = next_token_logprobs(model, ids)[:-1]
    nll = -logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean()
    return float(torch.exp(nll))


@torch.inference_mode()
def greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens


@dataclasses.dataclass(frozen=True)
class RequantisationCost:
    """The de-quantised model with only its re-quantised weights swapped in."""

    distance: dict[str, float]  # file type → relative RMS distance from the file's weights
    linears: int
    perplexity: float
    greedy_agreement: list[int]  # tokens equal to the de-quantised model's, per prompt


@torch.inference_mode()
def requantisation_cost(
    model: Any, loaded: BenchModel, ids: list[int], prompts: list[list[int]], new_tokens: int
) -> RequantisationCost | None:
    """The de-quantised ``model``'s perplexity and greedy tokens with its re-quantised
    types' weights swapped for what their planes hold (restored after); None where the
    file has no such type."""
    from sluice.engine.gguf_packed import block_tensors, requantisation_error

    tensors = block_tensors(model, loaded.folder, loaded.source)
    swapped = {n: w for n, w in tensors.packable.items() if w.requantised}
    if not swapped:
        return None
    params = dict(model.named_parameters(remove_duplicate=False))
    kept = {name: params[name].detach().clone() for name in swapped}
    before = [greedy(model, prompt, new_tokens) for prompt in prompts]
    for name, weight in swapped.items():
        params[name].copy_(torch.from_numpy(weight.dequantize()))
    try:
        ppl = perplexity(model, ids)
        after = [greedy(model, prompt, new_tokens) for prompt in prompts]
    finally:
        for name, original in kept.items():
            params[name].copy_(original)
    return RequantisationCost(
        distance=requantisation_error(list(swapped.values())),
        linears=len(swapped),
        perplexity=ppl,
        greedy_agreement=[agreement(a, b) for a, b in zip(before, after, strict=True)],
    )


def agreement(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def batch_agreement(scheduler: ModelScheduler, prompts: list[list[int]], new_tokens: int) -> float:
    """The share of prompts whose greedy tokens are the same alone and 16 at a time."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    as_tuples = [tuple(p) for p in prompts]
    alone: dict[int, list[int]] = {}
    together: dict[int, list[int]] = {}
    drive(scheduler, as_tuples, 1, params, tag="alone", tokens=alone)
    drive(scheduler, as_tuples, 16, params, tag="batch", tokens=together)
    return sum(alone[i] == together[i] for i in range(len(prompts))) / len(prompts)


@torch.inference_mode()
def step_seconds(scheduler: ModelScheduler, rows: int, chunk: int) -> float:
    """One forward plus the LM head: ``rows`` decode rows, or one ``chunk``-token prefill."""
    runner = scheduler.runner
    if chunk:
        ids = torch.ones(1, chunk, dtype=torch.long)
        positions = torch.arange(chunk).unsqueeze(0)
        begin = time.perf_counter()
        hidden = runner.forward(slice(0, 1), ids, positions)
    else:
        ids = torch.ones(rows, 1, dtype=torch.long)
        positions = torch.full((rows, 1), 128, dtype=torch.long)
        begin = time.perf_counter()
        hidden = runner.forward(slice(0, rows), ids, positions)
    runner.head(hidden[:, -1]).argmax(dim=1).tolist()
    return time.perf_counter() - begin


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="quantization", description=__doc__.split("\n\n")[0])
    add_model_args(p, dtype="float32", quantization=NONE)
    p.add_argument("--method", choices=QUANTIZATION_METHODS[1:], default=GGUF)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    print_machine()
    loaded = bench_model(args)
    tokenizer, folder, dtype = loaded.tokenizer, loaded.folder, loaded.dtype
    models = {"base": loaded.load(), "quantized": loaded.load(args.method)}
    print(f"model {folder.name}, {dtype} around the {args.method} GEMMs, {args.threads} threads")

    text_ids = tokenizer.encode(TEXT.read_text())
    ppl = {name: perplexity(model, text_ids) for name, model in models.items()}
    print(
        f"perplexity on {TEXT.name} ({len(text_ids)} tokens): {dtype} {ppl['base']:.3f}, "
        f"{args.method} {ppl['quantized']:.3f} (×{ppl['quantized'] / ppl['base']:.3f})"
    )
    stride = (len(text_ids) - PROMPT_TOKENS) // args.prompts
    prompts = [text_ids[i * stride : i * stride + PROMPT_TOKENS] for i in range(args.prompts)]
    agreed = [
        agreement(
            greedy(models["base"], prompt, args.new_tokens),
            greedy(models["quantized"], prompt, args.new_tokens),
        )
        for prompt in prompts
    ]
    identical = sum(a == args.new_tokens for a in agreed)
    print(
        f"greedy agreement with {dtype} over {args.prompts} prompts of the text: "
        f"{identical}/{args.prompts} identical for {args.new_tokens} tokens, "
        f"median {statistics.median(agreed):.0f} tokens before the first difference"
    )

    requantised = None
    if args.method == GGUF:
        requantised = requantisation_cost(
            models["base"], loaded, text_ids, prompts, args.new_tokens
        )
    if requantised is not None:
        distance = ", ".join(f"{t} {d:.2%}" for t, d in requantised.distance.items())
        unchanged = sum(a == args.new_tokens for a in requantised.greedy_agreement)
        print(
            f"re-quantised alone ({requantised.linears} linears, relative RMS distance "
            f"{distance}; the rest {dtype}): perplexity {requantised.perplexity:.3f} "
            f"(×{requantised.perplexity / ppl['base']:.3f}), greedy agreement with {dtype} "
            f"{unchanged}/{args.prompts} identical for {args.new_tokens} tokens"
        )

    schedulers = {
        name: build_scheduler(
            model,
            SchedulerConfig(max_running=64, context_length=8192),
            eos_token_ids=frozenset({tokenizer.eos_token_id}),
            device=torch.device("cpu"),
        )
        for name, model in models.items()
    }
    same = {
        name: batch_agreement(sch, prompts, args.new_tokens) for name, sch in schedulers.items()
    }
    print(
        f"alone vs 16 at a time, identical greedy tokens: {dtype} {same['base']:.0%}, "
        f"{args.method} {same['quantized']:.0%}"
    )

    shapes = [(rows, 0) for rows in (1, 4, 16, 64)] + [(1, 512)]
    for sch in schedulers.values():
        sch.cache.resize(max(sch.cache.slots, 64), max(sch.cache.capacity, 512))
    times: dict[tuple[str, int, int], list[float]] = {}
    for _ in range(args.rounds + 1):  # the first round warms up and is dropped
        for rows, chunk in shapes:
            for name, sch in schedulers.items():
                times.setdefault((name, rows, chunk), []).append(step_seconds(sch, rows, chunk))
    speed = []
    for rows, chunk in shapes:
        base = statistics.median(times["base", rows, chunk][1:])
        quantized = statistics.median(times["quantized", rows, chunk][1:])
        what = f"prefill chunk {chunk:>3} tokens" if chunk else f"decode step {rows:>2} rows"
        speed.append({"rows": rows, "chunk": chunk, "base_s": base, "quantized_s": quantized})
        print(
            f"{what}: {dtype} {base * 1000:6.1f} ms, {args.method} {quantized * 1000:6.1f} ms, "
            f"speed-up ×{base / quantized:.2f}"
        )
    if args.json:
        record = {
            "perplexity": ppl,
            "greedy_agreement": agreed,
            "requantised": requantised and dataclasses.asdict(requantised),
            "batch_identical": same,
        }
        args.json.write_text(json.dumps({**record, "speed": speed}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

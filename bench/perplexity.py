"""Perplexity of the model Sluice serves against llama.cpp's ``llama-perplexity`` on the
same GGUF file and text, computed the way that tool computes it.

    python -P -m sluice.bench.perplexity [--model-path X.gguf] [--ctx 128]

``llama-perplexity`` (built beside llama-server by ``make peers``) cuts the text's
tokens into chunks of ``--ctx``, starts each chunk with BOS where the vocabulary adds
one, and scores the second half of each chunk (the first half is context). Here the
same chunks and positions are scored by Sluice's models: the model as served with no
flags (the file's own blocks, packed, in the precision ``--dtype auto`` takes; fed one
token a forward, so the packed kernel multiplies, as in decoding) and the de-quantised
fp32 model. Prints each perplexity, the ratios, the
CPU and the command lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from sluice.bench.in_process import add_model_args, bench_model
from sluice.bench.machine import print_machine
from sluice.engine.fused_projections import quantization_of
from sluice.engine.quantization import GGUF, NONE

TEXT = Path(__file__).parent / "data" / "public_domain.txt"
LLAMA_PERPLEXITY = Path("build/peers/llama-perplexity")
_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


@torch.inference_mode()
def next_token_logprobs(model: Any, ids: list[int], piece: int | None = None) -> torch.Tensor:
    """``[len(ids), vocab]`` log-probabilities of the token after each position, the
    model fed ``piece`` tokens a forward over its own cache. By default a packed model
    is fed one token at a time, as it decodes (the packed kernel multiplies; a longer
    forward may take the de-quantised weight kept for many rows), any other 128."""
    from transformers import DynamicCache

    if piece is None:
        piece = 1 if quantization_of(model) == GGUF else 128
    cache = DynamicCache(config=model.config)
    out = []
    for start in range(0, len(ids), piece):
        chunk = torch.tensor([ids[start : start + piece]])
        logits = model(input_ids=chunk, cache=cache, use_cache=True).logits
        out.append(logits[0].float().log_softmax(-1))
    return torch.cat(out)


def chunked_perplexity(model: Any, tokens: list[int], ctx: int, bos: int | None) -> float:
    """llama-perplexity's figure: over chunks of ``ctx`` tokens (BOS first where the
    vocabulary adds one), the mean negative log-likelihood of each chunk's tokens after
    its first half, exponentiated."""
    first = ctx // 2
    nll, count = 0.0, 0
    for start in range(0, len(tokens) - ctx + 1, ctx):
        chunk = tokens[start : start + ctx]
        if bos is not None:
            chunk[0] = bos
        logprobs = next_token_logprobs(model, chunk)
        for j in range(first, ctx - 1):
            nll -= float(logprobs[j, chunk[j + 1]])
            count += 1
    return math.exp(nll / count)


def llama_perplexity(binary: Path, gguf: Path, ctx: int, threads: int) -> tuple[float, float]:
    cmd = [str(binary), "-m", str(gguf), "-f", str(TEXT), "-c", str(ctx), "-b", str(ctx),
           "-t", str(threads)]  # fmt: skip
    print("llama-perplexity:", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    found = _FINAL.search(out.stdout + out.stderr)
    if found is None:
        raise SystemExit(f"no final estimate in llama-perplexity's output:\n{out.stderr[-2000:]}")
    return float(found.group(1)), float(found.group(2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="perplexity", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--ctx", type=int, default=128, help="llama-perplexity's -c")
    p.add_argument("--llama-perplexity", type=Path, default=LLAMA_PERPLEXITY)
    args = p.parse_args(argv)
    print_machine()
    print("command: python -P -m sluice.bench.perplexity", *(argv or sys.argv[1:]))
    loaded = bench_model(args)
    tokenizer = loaded.tokenizer
    tokens: list[int] = tokenizer(TEXT.read_text()).input_ids
    adds_bos = tokenizer.bos_token_id is not None and tokens[:1] == [tokenizer.bos_token_id]
    bos = tokenizer.bos_token_id if adds_bos else None
    chunks = len(tokens) // args.ctx
    scored = chunks * (args.ctx - 1 - args.ctx // 2)
    print(f"{TEXT.name}: {len(tokens)} tokens, {chunks} chunks of {args.ctx}, {scored} scored, "
          f"BOS {'first' if bos else 'none'}")  # fmt: skip
    figures = {}
    served = (f"served ({loaded.quantization.method}, {loaded.dtype})", loaded)
    reference = ("de-quantised float32", dataclasses.replace(loaded, dtype="float32"))
    for (name, model), method in ((served, None), (reference, NONE)):
        figures[name] = chunked_perplexity(model.load(method), list(tokens), args.ctx, bos)
        print(f"Sluice {name}: PPL {figures[name]:.4f}", flush=True)
    if not args.llama_perplexity.exists():
        print(f"llama-perplexity: {args.llama_perplexity} not built (make peers)")
        return 0
    ppl, error = llama_perplexity(args.llama_perplexity, loaded.source, args.ctx, args.threads)
    print(f"llama-perplexity: PPL {ppl:.4f} ± {error:.4f}")
    for name, value in figures.items():
        print(f"Sluice {name} ÷ llama-perplexity: ×{value / ppl:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

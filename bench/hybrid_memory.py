"""A state-space model's cache against an attention model's of the same size, in the
engine alone (issue #25).

Two random models built from transformers configs (no weights are downloaded): a
Mamba-2 model and a Llama model with the same hidden size and vocabulary and about as
many parameters (a Mamba-2 block has no MLP, so the model has twice the layers, as
Mamba's papers compare them). Prints each one's parameters, its cache bytes per sequence at several
context lengths (a recurrent state is one fixed size; keys and values grow with every
position), and its output tok/s at each concurrency, rounds interleaved A B A B
(greedy, ``ignore_eos``, ``--prompt-tokens`` prompts, ``--new-tokens`` each):

    python -P -m sluice.bench.hybrid_memory --concurrency 1,16 --rounds 2
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from sluice.bench.engine_only import drive
from sluice.bench.machine import print_machine
from sluice.engine.assembly import ModelScheduler, build_scheduler
from sluice.engine.loader import load_causal_lm
from sluice.engine.params import SamplingParams
from sluice.engine.scheduler import SchedulerConfig

HIDDEN, VOCAB = 512, 16384
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # Mamba-2's usual shape: expand 2, 64-wide heads, a 128-wide state.
    "mamba2": (
        "mamba2",
        {
            "num_hidden_layers": 24,
            "num_heads": 16,
            "head_dim": 64,
            "state_size": 128,
            "n_groups": 1,
            "expand": 2,
        },
    ),
    "llama": (
        "llama",
        {
            "num_hidden_layers": 12,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "intermediate_size": 1536,
        },
    ),
}
CONTEXTS = (512, 2048, 8192, 32768)


def build(model_type: str, settings: dict[str, Any], folder: Path) -> Any:
    config = AutoConfig.for_model(
        model_type,
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
        **settings,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return load_causal_lm(folder, dtype="float32", device="cpu")


def scheduler(model: Any, concurrency: int) -> ModelScheduler:
    config = SchedulerConfig(max_running=concurrency, context_length=max(CONTEXTS))
    return build_scheduler(model, config, eos_token_ids=frozenset(), device=torch.device("cpu"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    print_machine()
    print(f"models: hidden {HIDDEN}, vocabulary {VOCAB}, fp32, random weights")
    models: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, (model_type, settings) in MODELS.items():
            models[name] = build(model_type, settings, Path(folder) / name)
    print("\ncache bytes per sequence, by context length:")
    print(f"{'model':8} {'layers':>6} {'params':>12} " + " ".join(f"{n:>13}" for n in CONTEXTS))
    for name, model in models.items():
        cache = scheduler(model, 1).cache
        params = sum(p.numel() for p in model.parameters())
        layers = model.config.num_hidden_layers
        per_seq = " ".join(f"{cache.bytes_for(1, n):>13,}" for n in CONTEXTS)
        print(f"{name:8} {layers:>6} {params:>12,} {per_seq}")
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    print("\noutput tok/s (rounds interleaved):")
    for level in levels:
        prompts = [
            tuple(rng.randrange(3, VOCAB) for _ in range(args.prompt_tokens))
            for _ in range(2 * level)
        ]
        rates: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(args.rounds):
            for name, model in models.items():
                seconds, generated = drive(scheduler(model, level), prompts, level, params)
                rates[name].append(generated / seconds)
        line = ", ".join(
            f"{name} {' / '.join(f'{r:.1f}' for r in rounds)}" for name, rounds in rates.items()
        )
        ratio = sum(rates["mamba2"]) / sum(rates["llama"])
        print(f"C={level}: {line}; mamba2 ÷ llama {ratio:.2f}")


if __name__ == "__main__":
    main()

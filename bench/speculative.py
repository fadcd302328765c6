"""N-gram speculative decoding against plain decoding, in the engine alone, as ratios.

One model, one scheduler per configuration, rounds interleaved A B A B on the same
requests (greedy, closed loop at ``--concurrency``). Workloads:

- ``copy``: a chat request to repeat a passage of ``bench/data/public_domain.txt``
  word for word (its output quotes its prompt);
- ``json``: a chat request to copy a JSON record (repeated keys and quoted values);
- ``random``: the README's workload (≈64 random words, 64 tokens, ``ignore_eos``),
  whose outputs rarely repeat: what drafting costs when it does not pay.

Prints each configuration's output tok/s, TTFT and ITL percentiles and its ratios to
plain decoding, the share of drafted tokens kept, and how many outputs differ from
plain decoding's (none should: the drafts are verified)::

    python -P -m sluice.bench.speculative --workload copy,json,random --concurrency 1,4,16 \\
        --configs plain,ngram:4,ngram:8,ngram:16 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sluice.bench.in_process import add_model_args, bench_model
from sluice.bench.load_client import make_prompt
from sluice.bench.machine import print_machine
from sluice.bench.mixed_chunk import interleaved_rounds, summarise_rounds
from sluice.engine.assembly import build_scheduler
from sluice.engine.params import SamplingParams
from sluice.engine.scheduler import SchedulerConfig
from sluice.engine.speculative import SpeculativeConfig

TEXT = Path(__file__).parent / "data" / "public_domain.txt"
FIRST_NAMES = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Frances", "John"]
FIELDS = ["mathematics", "computing", "logic", "compilers", "networks", "cryptography"]


def parse_configs(text: str) -> list[tuple[str, SpeculativeConfig | None]]:
    """``plain,ngram:8`` → [(label, speculative config or None), …]."""
    configs: list[tuple[str, SpeculativeConfig | None]] = []
    for item in text.split(","):
        kind, _, size = item.partition(":")
        if kind == "plain" and not size:
            configs.append((item, None))
        elif kind == "ngram" and size.isdigit():
            configs.append((item, SpeculativeConfig(num_draft_tokens=int(size))))
        else:
            raise SystemExit(f"bad config {item!r}: use plain or ngram:N")
    return configs


def workloads(tokenizer: Any) -> dict[str, tuple[Callable[[random.Random], str], SamplingParams]]:
    """Workload name → (a prompt from a random source, its sampling)."""
    words = TEXT.read_text().split()

    def chat(content: str) -> str:
        return str(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
        )

    def copy(rng: random.Random) -> str:
        start = rng.randrange(len(words) - 60)
        passage = " ".join(words[start : start + 40])
        return chat("Repeat the following text word for word:\n\n" + passage)

    def record(rng: random.Random) -> str:
        body = {
            "id": rng.randrange(1000, 9999),
            "name": f"{rng.choice(FIRST_NAMES)} {rng.choice(FIRST_NAMES)}son",
            "born": f"{rng.randrange(1800, 1990)}-{rng.randrange(1, 13):02d}-"
            f"{rng.randrange(1, 29):02d}",
            "fields": rng.sample(FIELDS, 2),
            "active": rng.random() < 0.5,
        }
        return chat("Copy this JSON exactly, nothing else:\n" + json.dumps(body))

    natural = SamplingParams(max_tokens=128, temperature=0.0)
    return {
        "copy": (copy, natural),
        "json": (record, natural),
        "random": (
            lambda rng: make_prompt(rng, 64),
            SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True),
        ),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--workload", default="copy,json,random")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests", type=int, help="per round and level (default 4×C, at least 8)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--configs", default="plain,ngram:8")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    print_machine()
    configs = parse_configs(args.configs)
    loaded = bench_model(args)
    tokenizer, model, folder, dtype = loaded.tokenizer, loaded.load(), loaded.folder, loaded.dtype
    known = workloads(tokenizer)
    print(f"model {folder.name} dtype {dtype} threads {args.threads} configs {args.configs}")
    report: list[dict[str, object]] = []
    for name in args.workload.split(","):
        if name not in known:
            raise SystemExit(f"unknown workload {name!r}: one of {', '.join(known)}")
        make, params = known[name]
        for c in (int(level) for level in args.concurrency.split(",")):
            schedulers = {
                label: build_scheduler(
                    model,
                    SchedulerConfig(max_running=max(c, 16), context_length=8192, speculative=spec),
                    eos_token_ids=frozenset({tokenizer.eos_token_id}),
                    device=torch.device("cpu"),
                )
                for label, spec in configs
            }
            n = args.requests or max(4 * c, 8)
            rng = random.Random(f"{name}/{c}")
            print(f"\n== workload {name}, C={c}, {n} requests a round")
            prompt_rounds = [
                [tuple(tokenizer.encode(make(rng))) for _ in range(n)] for _ in range(args.rounds)
            ]
            runs, outputs = interleaved_rounds(schedulers, prompt_rounds, c, params)
            rows = summarise_rounds(configs[0][0], runs, outputs) if args.rounds else []
            for label, scheduler in schedulers.items():
                if scheduler.draft_tokens:
                    kept = scheduler.accepted_tokens / scheduler.draft_tokens
                    print(f"{label}: {kept:.0%} of {scheduler.draft_tokens} drafted tokens kept")
            report += [{"workload": name, "concurrency": c, **row} for row in rows]
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

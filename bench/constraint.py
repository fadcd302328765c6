"""What a grammar constraint costs per generated token, engine only.

``python -P -m sluice.bench.constraint`` loads the model once and runs the same
chat prompts through the step scheduler with and without a constraint, interleaved
(A B A B …) so drift in the machine's speed hits both alike, at each concurrency
level (every request of a run constrained, or none). It prints seconds per
generated token for each and their ratio (constrained / unconstrained), median over
the rounds. Two constraints: a JSON schema (the output ends when the document is
complete, so the token counts differ; per-token time is what compares) and a regex
of unbounded length with ``ignore_eos`` (the same token count as the unconstrained
run). The grammar's first compile is done before timing; each request still makes
its own matcher, as the server does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from sluice.bench.engine_only import drive
from sluice.bench.machine import print_machine
from sluice.engine.assembly import build_scheduler
from sluice.engine.grammar import TokenGrammar
from sluice.engine.loader import load_causal_lm, load_tokenizer, resolve_model
from sluice.engine.params import Constraint, SamplingParams
from sluice.engine.scheduler import SchedulerConfig

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
SUBJECTS = ["a baker", "a pilot", "a painter", "a nurse", "a farmer", "a chemist", "a poet"]
CONSTRAINTS = {
    "json_schema": Constraint("json_schema", json.dumps(PERSON)),
    "regex": Constraint("regex", r"[A-Za-z ,.']+"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="constraint", description=__doc__)
    p.add_argument("--model-path")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    print_machine()
    torch.set_num_threads(args.threads)
    folder = resolve_model(args.model_path).folder
    tokenizer = load_tokenizer(folder)
    model = load_causal_lm(folder, dtype="float32", device="cpu")
    eos = frozenset({tokenizer.eos_token_id})
    levels = [int(c) for c in args.concurrency.split(",")]
    grammar = TokenGrammar(tokenizer, eos_token_ids=eos)
    for constraint in CONSTRAINTS.values():
        grammar.matcher(constraint)  # compiled once, as the server's cache would have it
    scheduler = build_scheduler(
        model,
        SchedulerConfig(max_running=max(levels), context_length=8192),
        eos_token_ids=eos,
        device=torch.device("cpu"),
        grammar=grammar,
    )
    print(f"threads={args.threads} max_tokens={args.max_tokens} rounds={args.rounds}")
    for c in levels:
        prompts = [
            tuple(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": f"Describe {SUBJECTS[i % len(SUBJECTS)]}."}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            )
            for i in range(2 * c)
        ]
        for name, constraint in CONSTRAINTS.items():
            # The regex never completes: with ignore_eos both runs make max_tokens each.
            same_length = name == "regex"
            free = SamplingParams(
                max_tokens=args.max_tokens, temperature=0.0, ignore_eos=same_length
            )
            bound = SamplingParams(
                max_tokens=args.max_tokens,
                temperature=0.0,
                ignore_eos=same_length,
                constraint=constraint,
            )
            ratios, per_free, per_bound = [], [], []
            for r in range(args.rounds):
                s_a, n_a = drive(scheduler, prompts, c, free, f"a{r}")
                s_b, n_b = drive(scheduler, prompts, c, bound, f"b{r}")
                per_free.append(s_a / n_a)
                per_bound.append(s_b / n_b)
                ratios.append(per_bound[-1] / per_free[-1])
            print(
                f"C={c:<2} {name:<11} unconstrained {statistics.median(per_free) * 1e3:6.2f} "
                f"ms/token, constrained {statistics.median(per_bound) * 1e3:6.2f} ms/token, "
                f"ratio {statistics.median(ratios):.3f} (rounds: "
                + " ".join(f"{x:.3f}" for x in ratios)
                + f"; tokens {n_a} vs {n_b})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

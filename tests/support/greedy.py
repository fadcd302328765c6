"""``model.generate``'s greedy run as a same-machine reference: the tokens and each
step's logits, from which the tests read logprobs, alternatives and how far each
choice was from a tie."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class GreedyRun:
    tokens: list[int]
    logits: list[torch.Tensor]  # one fp32 row over the vocabulary a step

    def logprobs(self) -> list[float]:
        """Each chosen token's log-probability."""
        steps = zip(self.logits, self.tokens, strict=True)
        return [float(row.log_softmax(-1)[token]) for row, token in steps]

    def margins(self) -> list[float]:
        """Each step's lead of the chosen token over the runner-up, in logits."""
        return [float(row.topk(2).values.diff().neg()) for row in self.logits]


def greedy_run(model: Any, ids: list[int], n: int) -> GreedyRun:
    """Up to ``n`` greedy tokens after ``ids`` (fewer when EOS comes first)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(ids) :].tolist()
    return GreedyRun(tokens, [step[0].float() for step in out.logits])

"""What one forward of a step runs, and what it gives back: the seam between the
scheduler (which plans and then updates its sequences) and the runner (which
executes).

A ``StepPlan`` lists the decode runs (each row's last token and its speculative
draft) and the prompt chunks of one forward, in slot order, and which slots they
occupy. The runner's forward reads only tokens, positions and slots; sampling
(``step_sampler``), on the device the logits are on, reads each entry's sampling
state (``Sequence.row``) and returns ``StepSamples``: the tokens and logprobs that
``update`` acts on, the only thing of a step that reaches the host.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

import torch

from sluice.events.types import TokenLogprob

from .sequence import Sequence

if TYPE_CHECKING:
    from .grammar import TokenGrammar


class ForwardKind(Enum):
    DECODE = "decode"  # one token per decoding row (plus its draft, if any)
    PREFILL = "prefill"  # prompt chunks alone, padded to the widest
    MIXED = "mixed"  # decode runs and prompt chunks in one packed forward


@dataclass(frozen=True)
class DecodeRun:
    """A decoding row: its last token, then the draft to verify, from ``start``."""

    seq: Sequence
    start: int
    tokens: tuple[int, ...]

    @property
    def draft(self) -> tuple[int, ...]:
        return self.tokens[1:]


@dataclass(frozen=True)
class PromptChunk:
    """``tokens`` of a prompt written from ``start``. ``completes``: the prompt's last
    chunk, whose last position's logits give the first token. ``scored``: how many
    of its positions predict a prompt token whose logprob was asked for."""

    seq: Sequence
    start: int
    tokens: tuple[int, ...]
    completes: bool
    scored: int


@dataclass(frozen=True)
class StepPlan:
    kind: ForwardKind
    decode: tuple[DecodeRun, ...] = ()
    chunks: tuple[PromptChunk, ...] = ()
    # The slots the chunks occupy start here (decode runs start at slot 0).
    chunk_slot: int = 0
    # Set when some row is constrained: the rows with a matcher sample through it.
    grammar: TokenGrammar | None = None

    @property
    def drafted(self) -> bool:
        return any(run.draft for run in self.decode)


@dataclass(frozen=True)
class StepLogits:
    """Logits of one executed plan, on the device the forward ran on.

    ``decode``: one row per decode-run position, runs in order (a run of a token and
    a 3-token draft has 4 rows), in the head's dtype (the sampler widens what it
    computes on). ``first``: one row per completing chunk, in order.
    ``scored``: per chunk, its ``scored`` positions' rows (None where none)."""

    decode: torch.Tensor | None
    first: torch.Tensor | None  # float32, as ``scored``
    scored: Seq[torch.Tensor | None]


@dataclass(frozen=True)
class Sampled:
    """The token chosen at one position; with ``error``, none could be (the row's
    sampling failed alone) and its sequence ends with that error."""

    token: int
    logprob: TokenLogprob | None
    error: str | None = None


@dataclass(frozen=True)
class StepSamples:
    """What sampling chose for one executed plan.

    ``decode``: one entry per decode-run position, runs in order (as
    ``StepLogits.decode``), each sampled as if the run's draft before it was kept.
    ``rng_before``: per run, its generator's state before those draws, where a seeded
    sampled run drew for more positions than ``update`` may keep (it rewinds).
    ``first``: per chunk, the first token of a completed prompt (None where the
    chunk completes nothing, or nothing is to be generated). ``prompt_logprobs``: per
    chunk, its scored positions' logprobs (None where none)."""

    decode: tuple[Sampled, ...] = ()
    rng_before: tuple[Any, ...] = ()
    first: tuple[Sampled | None, ...] = ()
    prompt_logprobs: tuple[tuple[TokenLogprob, ...] | None, ...] = ()


class StepRunner(Protocol):
    """Executes plans; ``ModelRunner`` over a model, a scripted one in tests."""

    # Whether this runner can pack decode runs and prompt chunks into one forward
    # (needed for ``ForwardKind.MIXED`` and for drafts).
    packs: bool

    def execute(self, plan: StepPlan) -> StepSamples: ...

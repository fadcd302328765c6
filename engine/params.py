"""What a caller asks of the engine for one sequence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# What a grammar constraint is written in. ``json_object`` needs no source (any JSON
# object); ``lark`` is the internal format the tool-calling layer composes (llguidance's
# Lark dialect, with ``%json{...}`` schema embeds); ``ebnf`` is SGLang's GBNF-style
# grammar.
ConstraintKind = Literal["json_schema", "json_object", "regex", "ebnf", "lark"]


@dataclass(frozen=True, slots=True)
class Constraint:
    """A grammar the sampled tokens must follow, enforced by a token mask each step.

    ``source`` is the schema as JSON text, the regex, or the grammar text.
    """

    kind: ConstraintKind
    source: str = ""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-sequence sampling, already validated by the HTTP layer.

    ``temperature == 0`` means greedy. ``top_k == -1`` disables top-k. ``seed``
    makes a sampled sequence reproducible: the same request gives the same tokens.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the chosen token plus the top k
    prompt_logprobs: int | None = None  # same, for every prompt token (``echo``)
    constraint: Constraint | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def needs_filtering(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0


@dataclass(frozen=True, slots=True)
class SequenceSpec:
    """One sequence (one choice of one request) to generate."""

    request_id: str
    choice_index: int
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Requests with the same key go to the same engine worker while it is not
    # overloaded (``--dp-size``): the client's ``prompt_cache_key``, else its ``user``.
    routing_key: str | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.choice_index)

    def token_id_problem(self, vocab: int | None) -> str | None:
        """Why this sequence's token ids cannot index a vocabulary of ``vocab``, or None.
        The front end refuses such ids with a 400; the engine checks again, for every
        other way in."""
        if vocab is None:
            return None
        for what, ids in (
            ("prompt", self.prompt_ids),
            ("logit_bias", [token for token, _ in self.sampling.logit_bias]),
            ("stop_token_ids", self.sampling.stop_token_ids),
        ):
            if ids and not (min(ids) >= 0 and max(ids) < vocab):
                return f"a token id of {what} is outside the vocabulary of {vocab} tokens"
        return None

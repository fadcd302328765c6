"""What a model says about itself: its context, its end and start tokens, its attention.

Everything here is read from the loaded model, its generation config and its
tokenizer, never assumed from a model family, so that a second model (Gemma 3: BOS on
every prompt, another EOS, sliding windows) is served by its own rules. ``/v1/models``
reports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .attention import AttentionLayout
from .fused_projections import quantization_of

# Where configs keep their trained context length, most common first.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
# Tokenizers without a real limit report a huge ``model_max_length``.
_NO_LIMIT = 10_000_000


@dataclass(frozen=True)
class ModelFacts:
    architecture: str
    context_length: int | None  # None: neither the config nor the tokenizer says
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    adds_bos: bool  # whether the tokenizer starts every encoded prompt with it
    layout: AttentionLayout
    quantization: str | None = None  # ``--quantization``'s method, where one was applied

    @classmethod
    def read(cls, model: Any, tokenizer: Any) -> ModelFacts:
        bos = getattr(tokenizer, "bos_token_id", None)
        probe = tokenizer.encode("a")
        return cls(
            architecture=type(model).__name__,
            context_length=_context_length(model.config, tokenizer),
            eos_token_ids=eos_token_ids(model, tokenizer),
            bos_token_id=bos,
            adds_bos=bos is not None and bool(probe) and probe[0] == bos,
            layout=AttentionLayout.for_model(model),
            quantization=quantization_of(model),
        )

    def card(self) -> dict[str, object]:
        """The facts as ``/v1/models`` lists them beside the OpenAI fields."""
        counts: dict[str, int] = {}
        for kind in self.layout.layer_types:
            counts[kind] = counts.get(kind, 0) + 1
        return {
            "architecture": self.architecture,
            "eos_token_ids": sorted(self.eos_token_ids),
            "bos_token_id": self.bos_token_id,
            "adds_bos_token": self.adds_bos,
            "attention": {
                "layer_types": counts,
                "sliding_window": self.layout.sliding_window,
                "implementation": "eager" if self.layout.additive_dtype is not None else "sdpa",
            },
            "quantization": self.quantization,
        }


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every id that ends a sequence: the generation config's (often several), the
    model config's and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def _context_length(config: Any, tokenizer: Any) -> int | None:
    for key in _CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < _NO_LIMIT:
        return limit
    return None

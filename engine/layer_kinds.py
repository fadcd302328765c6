"""The kinds of decoder layer the engine serves: the one place a new kind is added.

A ``LayerKind`` owns what the engine does differently for its layers: the settings it
reads from the model's config (``from_config``, which refuses a model it cannot
serve), the layout of its cache (``storage``: how a slot's state is held, grown,
copied and swapped), and the per-step metadata its kernel reads (``visible``: which
cached positions each query attends to; the model's own attention is the kernel,
handed that as its mask). Full and sliding-window attention share the dense key/value
layout (``kv_cache.DenseKV``) and differ in ``visible``. Chunked attention would be a
kind with a ``visible`` of its own; MLA's latent cache or a per-sequence recurrent
state (Mamba, linear attention, short convolutions) a kind with a ``storage`` of its
own. ``LAYER_KINDS`` maps transformers' ``config.layer_types`` names to kinds; a model
with a layer type not in it is refused at start-up, never served wrong.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .errors import UnsupportedModelError
from .kv_cache import DenseKV, LayerStorage

FULL = "full_attention"
SLIDING = "sliding_attention"


class LayerKind(ABC):
    name: ClassVar[str]

    @classmethod
    def from_config(cls, config: Any, architecture: str) -> LayerKind:
        """This kind with the model's settings; ``UnsupportedModelError`` if missing."""
        return cls()

    @abstractmethod
    def visible(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Whether each query (its position, ``[rows, 1, T, 1]``) reads each cached
        position of its slot (``[1, 1, 1, read_len]``): booleans, broadcast."""

    def storage(
        self,
        config: Any,
        layers: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        slots: int,
        capacity: int,
    ) -> LayerStorage:
        """The cache of ``layers`` layers of this kind (keys and values by default)."""
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        return DenseKV(
            layers=layers,
            kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
            slots=slots,
            capacity=capacity,
        )


@dataclass(frozen=True)
class FullAttention(LayerKind):
    """Every earlier position of the sequence, its own included."""

    name: ClassVar[str] = FULL

    def visible(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return keys <= queries


@dataclass(frozen=True)
class SlidingAttention(LayerKind):
    """The last ``window`` positions, its own included (transformers' ``kv > q - window``).
    The dense layout keeps every position, so its memory is a full layer's."""

    name: ClassVar[str] = SLIDING
    window: int

    @classmethod
    def from_config(cls, config: Any, architecture: str) -> LayerKind:
        window = getattr(config, "sliding_window", None)
        if not isinstance(window, int) or window < 1:
            raise UnsupportedModelError(
                f"{architecture} has sliding-window layers but no sliding_window size"
            )
        return cls(window)

    def visible(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return (keys <= queries) & (keys > queries - self.window)


LAYER_KINDS: dict[str, type[LayerKind]] = {k.name: k for k in (FullAttention, SlidingAttention)}

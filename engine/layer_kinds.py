"""The kinds of decoder layer the engine serves: the one place a new kind is added.

A ``LayerKind`` owns what the engine does differently for its layers: the settings it
reads from the model's config (``from_config``, which refuses a model it cannot
serve), the layout of its cache (``storage``: how a slot's state is held, grown,
copied and swapped), and the per-step metadata its kernel reads (``visible``: which
cached positions each query attends to; the model's own attention is the kernel,
handed that as its mask). Full, sliding-window and chunked attention (Llama 4's local
layers) share the dense key/value layout (``kv_cache.DenseKV``, in the widths
``cache_widths`` reads: an MLA model's compressed latent, or each head's keys and
values) and differ in ``visible``. State-space, linear-attention and short-convolution
layers (``linear_attention``: Mamba, Mamba 2, gated delta-net; ``conv``: LFM2) attend
to nothing (``attends``): they carry a per-sequence state instead, in a storage of
their own (``recurrent_state.RecurrentStates``); ``mlp`` and ``moe`` blocks listed as
layers of their own (Nemotron-H) keep nothing.
``LAYER_KINDS`` maps transformers' ``config.layer_types`` names to kinds; a model with
a layer type not in it is refused at start-up, never served wrong.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .cache_storage import LayerStorage, NoState
from .errors import UnsupportedModelError
from .kv_cache import DenseKV
from .recurrent_state import RecurrentStates

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"
LINEAR = "linear_attention"
CONV = "conv"


class LayerKind(ABC):
    name: ClassVar[str]
    # Whether its layers attend over cached positions (and take a mask).
    attends: ClassVar[bool] = True

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
        """The cache of ``layers`` layers of this kind: keys and values by default, of
        the widths ``cache_widths`` reads from the config."""
        heads, key_width, value_width = cache_widths(config)
        return DenseKV(
            layers=layers,
            kv_heads=heads,
            head_dim=key_width,
            value_dim=value_width,
            dtype=dtype,
            device=device,
            slots=slots,
            capacity=capacity,
        )


def cache_widths(config: Any) -> tuple[int, int, int]:
    """(heads, key width, value width) of what an attention layer writes per position.

    MLA models (a ``kv_lora_rank``) write their compressed latent as transformers' MLA
    attention hands it to the cache: one head, ``kv_lora_rank`` wide, and the shared
    rotary key, ``qk_rope_head_dim`` wide, instead of every head's expanded keys and
    values."""
    rank = getattr(config, "kv_lora_rank", None)
    if isinstance(rank, int) and rank > 0:
        return 1, rank, int(config.qk_rope_head_dim)
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return heads, head_dim, head_dim


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
        return cls(_size(config, "sliding_window", architecture, "sliding-window"))

    def visible(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return (keys <= queries) & (keys > queries - self.window)


@dataclass(frozen=True)
class ChunkedAttention(LayerKind):
    """Earlier positions of the query's own block of ``chunk`` positions (Llama 4's
    local layers; transformers' ``kv // chunk == q // chunk``). A block's first query
    sees itself only, so a prompt several blocks long differs from full attention at
    every block boundary."""

    name: ClassVar[str] = CHUNKED
    chunk: int

    @classmethod
    def from_config(cls, config: Any, architecture: str) -> LayerKind:
        return cls(_size(config, "attention_chunk_size", architecture, "chunked-attention"))

    def visible(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return (keys <= queries) & (keys // self.chunk == queries // self.chunk)


def _size(config: Any, setting: str, architecture: str, layers: str) -> int:
    """A kind's positive size read from the config; refused where it is missing."""
    size = getattr(config, setting, None)
    if not isinstance(size, int) or size < 1:
        raise UnsupportedModelError(f"{architecture} has {layers} layers but no {setting}")
    return size


class UnmaskedKind(LayerKind):
    """A kind whose layers attend to nothing, so take no mask."""

    attends: ClassVar[bool] = False

    def visible(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        raise AssertionError(f"{self.name} layers take no mask")


@dataclass(frozen=True)
class RecurrentLayer(UnmaskedKind):
    """A state-space or linear-attention mixer (Mamba, Mamba 2, gated delta-net): a
    per-sequence conv and recurrent state instead of keys and values."""

    name: ClassVar[str] = LINEAR

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
        return RecurrentStates(layers=layers, device=device, slots=slots)


@dataclass(frozen=True)
class ShortConvolution(RecurrentLayer):
    """LFM2's gated short convolution: a conv state only."""

    name: ClassVar[str] = CONV


@dataclass(frozen=True)
class FeedForward(UnmaskedKind):
    """An MLP block that a model lists as a layer of its own: no cache."""

    name: ClassVar[str] = "mlp"

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
        return NoState()


@dataclass(frozen=True)
class MixtureOfExperts(FeedForward):
    name: ClassVar[str] = "moe"


LAYER_KINDS: dict[str, type[LayerKind]] = {
    k.name: k
    for k in (
        FullAttention,
        SlidingAttention,
        ChunkedAttention,
        RecurrentLayer,
        ShortConvolution,
        FeedForward,
        MixtureOfExperts,
    )
}

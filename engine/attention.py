"""Which attention each decoder layer does, and the masks that tell it.

A step's rows each have their own positions in their own cache slot, which
transformers' mask builders cannot express (they take one offset for the batch), so
Sluice builds the 4-D masks itself; transformers uses a prepared 4-D mask as given.
A model whose layers all attend alike gets one mask; a hybrid model (Gemma 2/3,
Cohere2, GPT-OSS, Qwen2 with ``max_window_layers``) gets a mapping from layer type to
mask, which those models look each layer's mask up in.

Layer types follow transformers' ``config.layer_types``, each served by its
``layer_kinds.LayerKind`` (which says what a query sees: ``full_attention`` every
earlier position of its sequence, ``sliding_attention`` the last ``sliding_window``;
a recurrent kind, ``linear_attention`` or ``conv``, no mask at all).
Models without ``layer_types`` slide in every layer when they are configured with a
window and their code builds sliding masks at all (Mistral, Phi-3, Qwen3-MoE). A
layer type with no kind is refused when the model loads, never served with wrong
masks.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import UnsupportedModelError
from .layer_kinds import FULL, LAYER_KINDS, SLIDING, LayerKind

# The attention implementations that ``packed`` registers for mixed steps, and what
# each wraps (which decides the mask format).
PACKED = "sluice_packed"
PACKED_EAGER = "sluice_packed_eager"
PACKED_WRAPS = {PACKED: "sdpa", PACKED_EAGER: "eager"}

Mask = torch.Tensor | dict[str, torch.Tensor | None] | None


@dataclass(frozen=True)
class AttentionLayout:
    """Each layer's attention type, and how the attention implementation reads masks.

    ``kinds`` (type → its ``LayerKind``) are the engine's, built by ``for_model``; a
    layout described by a worker's hello (the ``--dp-size`` front end's) has none and
    builds no masks."""

    layer_types: tuple[str, ...]
    sliding_window: int | None
    # Eager attention adds the mask to the scores (0 or the dtype's minimum); SDPA
    # takes booleans (True: attend).
    additive_dtype: torch.dtype | None = None
    kinds: Mapping[str, LayerKind] = field(default_factory=dict, compare=False)

    @classmethod
    def for_model(cls, model: Any) -> AttentionLayout:
        config = model.config
        layers = int(config.num_hidden_layers)
        window = getattr(config, "sliding_window", None)
        declared = getattr(config, "layer_types", None)
        if declared:
            types = tuple(str(t) for t in declared)
        elif window is not None and _builds_sliding_masks(model):
            types = (SLIDING,) * layers
        else:
            types = (FULL,) * layers
        architecture = type(model).__name__
        unknown = sorted(set(types) - set(LAYER_KINDS))
        if unknown:
            raise UnsupportedModelError(
                f"{architecture} has {', '.join(unknown)} layers; Sluice serves "
                f"{', '.join(sorted(LAYER_KINDS))} layers"
            )
        if len(types) != layers:
            raise UnsupportedModelError(
                f"{architecture} declares {len(types)} layer types for {layers} layers"
            )
        kinds = {t: LAYER_KINDS[t].from_config(config, architecture) for t in dict.fromkeys(types)}
        implementation = getattr(config, "_attn_implementation", "sdpa")
        # Packed for mixed steps (``packed``): the masks are those of what it wraps.
        implementation = PACKED_WRAPS.get(implementation, implementation)
        if implementation not in ("sdpa", "eager"):
            raise UnsupportedModelError(
                f"{architecture} was loaded with attention {implementation!r}; "
                "Sluice builds masks for 'sdpa' and 'eager'"
            )
        dtype = next(model.parameters()).dtype if implementation == "eager" else None
        return cls(types, window if SLIDING in types else None, dtype, kinds)

    @property
    def hybrid(self) -> bool:
        return len(set(self.layer_types)) > 1

    def masks(self, positions: torch.Tensor, read_len: int) -> Mask:
        """Masks ``[rows, 1, T, read_len]`` for queries at ``positions`` ``[rows, T]``
        over the first ``read_len`` positions of each row's own slot."""
        keys = torch.arange(read_len, device=positions.device).view(1, 1, 1, -1)
        queries = positions.view(positions.shape[0], 1, -1, 1)
        by_type = {
            kind: self._encode(self.kinds[kind].visible(queries, keys))
            if self.kinds[kind].attends
            else None
            for kind in dict.fromkeys(self.layer_types)
        }
        if self.hybrid:
            return by_type
        return next(iter(by_type.values()))

    def _encode(self, visible: torch.Tensor) -> torch.Tensor:
        if self.additive_dtype is None:
            return visible
        blocked = torch.finfo(self.additive_dtype).min
        zero = torch.zeros((), dtype=self.additive_dtype, device=visible.device)
        return torch.where(visible, zero, blocked)


def _builds_sliding_masks(model: Any) -> bool:
    """Whether the model's own code ever builds a sliding-window mask (a configured
    ``sliding_window`` that the code ignores must not change what Sluice computes)."""
    for cls in type(model.get_decoder()).__mro__:
        module = sys.modules.get(cls.__module__)
        if module is not None and hasattr(module, "create_sliding_window_causal_mask"):
            return True
    return False


def attention_implementation(config: Any) -> str:
    """SDPA, unless the model soft-caps attention scores, which SDPA cannot do
    (transformers then attends eagerly as well)."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "eager"
    return "sdpa"

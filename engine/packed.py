"""Mixed steps: decode rows and prefill chunks packed into one forward.

Without packing, a step that prefills runs two forwards (the prompt chunks, padded to
the widest, then one token per decoding row): every weight is read twice, and the
decoding streams wait for the prefill forward. Here every token of the step is one
position of a single packed row ``[1, N]`` (no padding: a decode row is one token, a
chunk is as many as it has), so the projections and MLPs run once over exactly the
step's tokens. Only attention needs the rows apart: each token attends over its own
slot. ``packed_attention`` is registered with transformers' ``AttentionInterface``
and, while a ``PackedBatch`` is bound, gathers each group's queries (the decode rows;
the prefill rows, padded to the widest chunk) into a batch over their slots, runs
SDPA with the group's masks, and scatters the outputs back to packed order. Unbound
(``model.generate``, the start-up probe, the fixed-shape decode step) it is plain SDPA.

Models whose attention is not plain SDPA (eager: soft-capped scores, attention sinks)
keep separate prefill and decode forwards.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .attention import AttentionLayout, Mask

PACKED = "sluice_packed"


@dataclass(frozen=True)
class RowGroup:
    """Rows of a packed forward that attend together: ``slots`` of the cache, each row's
    queries at ``gather`` (indices into the packed tokens, ``[rows, T]``; a row shorter
    than ``T`` repeats its last token, and ``valid`` marks the real ones)."""

    slots: slice
    gather: torch.Tensor
    valid: torch.Tensor
    read_len: int
    masks: Mask


@dataclass(frozen=True)
class PackedBatch:
    groups: tuple[RowGroup, ...]
    layer_types: tuple[str, ...]
    tokens: int


_bound = threading.local()


class bound:
    """``with bound(batch):`` — the packed forward about to run on this thread."""

    def __init__(self, batch: PackedBatch) -> None:
        self.batch = batch

    def __enter__(self) -> PackedBatch:
        _bound.batch = self.batch
        return self.batch

    def __exit__(self, *exc: object) -> None:
        _bound.batch = None


def packed_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    batch: PackedBatch | None = getattr(_bound, "batch", None)
    if batch is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    # query [1, H, N, hd]; key/value: the layer's whole cache [slots, kv, capacity, hd].
    per_token = query[0].transpose(0, 1)  # [N, H, hd]
    out = per_token.new_empty(per_token.shape[0], per_token.shape[1], value.shape[-1])
    kind = batch.layer_types[module.layer_idx]
    for group in batch.groups:
        q = per_token[group.gather].transpose(1, 2)  # [rows, H, T, hd]
        k = key[group.slots, :, : group.read_len]
        v = value[group.slots, :, : group.read_len]
        mask = group.masks[kind] if isinstance(group.masks, dict) else group.masks
        o, _ = sdpa_attention_forward(module, q, k, v, mask, **kwargs)  # [rows, T, H, hd]
        out[group.gather[group.valid]] = o[group.valid]
    return out.unsqueeze(0), None


AttentionInterface.register(PACKED, packed_attention)
AttentionMaskInterface.register(PACKED, sdpa_mask)


def group(
    slots: slice,
    gather: torch.Tensor,
    valid: torch.Tensor,
    positions: torch.Tensor,
    layout: AttentionLayout,
) -> RowGroup:
    """A group whose rows' queries sit at ``positions`` ``[rows, T]`` of their slots."""
    read_len = int(positions.max().item()) + 1
    return RowGroup(slots, gather, valid, read_len, layout.masks(positions, read_len))

"""Mixed steps: decode rows and prefill chunks packed into one forward.

Without packing, a step that prefills runs two forwards (the prompt chunks, padded to
the widest, then one token per decoding row): every weight is read twice, and the
decoding streams wait for the prefill forward. Here every token of the step is one
position of a single packed row ``[1, N]`` (no padding: a decode row is one token, a
chunk is as many as it has), so the projections and MLPs run once over exactly the
step's tokens. Only attention needs the rows apart: each token attends over its own
slot. The packed attention is registered with transformers' ``AttentionInterface``
and, while a ``PackedBatch`` is bound, gathers each group's queries (the decode rows;
the prefill rows, padded to the widest chunk) into a batch over their slots, runs
the model's attention with the group's masks, and scatters the outputs back to packed
order. Unbound (``model.generate``, the start-up probe, the fixed-shape decode step) it
is that attention alone. Two are registered: over SDPA (``PACKED``), and over the
model's own eager attention (``PACKED_EAGER``: Gemma 2's soft-capped scores, GPT-OSS's
sinks), which its modeling module defines. Where the direct decode step serves the
layers (``direct_decode``), a group of decode rows, or of short chunks, takes its
attention op instead, token by token over each token's slot (``OwnAttention``).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from .attention import PACKED, PACKED_EAGER, PACKED_WRAPS, AttentionLayout, Mask

__all__ = [
    "OWN_ATTENTION_READS",
    "OWN_ATTENTION_WIDTH",
    "PACKED",
    "PACKED_EAGER",
    "PACKED_WRAPS",
    "OwnAttention",
    "PackedBatch",
    "RowGroup",
    "bound",
    "group",
    "takes_own",
]


@dataclass(frozen=True)
class RowGroup:
    """Rows of a packed forward that attend together: ``slots`` of the cache, each row's
    queries at ``gather`` (indices into the packed tokens, ``[rows, T]``; a row shorter
    than ``T`` repeats its last token, and ``valid`` marks the real ones). The real
    tokens one by one: ``tokens`` (their packed indices), each one's slot and position
    (all int64 ``[n]``)."""

    slots: slice
    gather: torch.Tensor
    valid: torch.Tensor
    read_len: int
    masks: Mask
    tokens: torch.Tensor
    token_slots: torch.Tensor
    token_positions: torch.Tensor


@dataclass(frozen=True)
class OwnAttention:
    """A layer's attention as Sluice's ``decode_attention`` op computes it, token by
    token over its slot's cache: the layer's sliding window (0: full), score scale and
    soft-cap (0: none). The direct decode step (``direct_decode``) knows these for the
    layers it serves."""

    window: int
    scale: float
    softcap: float


# Which groups take ``decode_attention`` rather than SDPA: those of at most
# ``OWN_ATTENTION_WIDTH`` tokens a row (decode rows, their drafts), and those whose reads
# (a group's last position + 1) are at most ``OWN_ATTENTION_READS``. The op reads each
# token's keys on its own, which at the short prompts of a busy server saves SDPA's
# per-group gathers, masks and small GEMMs (≈5 % of a SmolLM2 profile at C=64 with AVX2
# alone); but the tokens of a long chunk each re-read a long prefix, where SDPA's blocked
# GEMMs share it. Four chunks of 128 tokens, SmolLM2's heads in float32 with AVX2 alone
# (emulated on a Zen 5): 0.62 of SDPA's time; one of 256: 1.26; 512 at 2048: 1.64.
OWN_ATTENTION_WIDTH = 8
OWN_ATTENTION_READS = 192


@dataclass(frozen=True)
class PackedBatch:
    groups: tuple[RowGroup, ...]
    layer_types: tuple[str, ...]
    # Each layer's ``OwnAttention``, where every layer has one; None: SDPA for every group.
    own: tuple[OwnAttention, ...] | None = None


_bound = threading.local()


class bound:
    """``with bound(batch):`` — the packed forward about to run on this thread."""

    def __init__(self, batch: PackedBatch) -> None:
        self.batch = batch

    def __enter__(self) -> PackedBatch:
        _bound.batch = self.batch
        return self.batch

    def __exit__(self, *exc: object) -> None:
        # Unbound again exactly as before the first bind: a compiled decode step guards
        # on this state (it traced ``getattr(_bound, "batch", None)`` finding no
        # attribute), and an attribute left set to None would fail that guard and
        # recompile every bucket, seconds each, while requests wait.
        del _bound.batch


Attention = Callable[..., tuple[torch.Tensor, Any]]


def _model_eager(module: Any) -> Attention:
    """The model's own eager attention (soft-caps, sinks and all), from its module."""
    inner: Attention = sys.modules[type(module).__module__].eager_attention_forward
    return inner


def calls_attention_interface(model: Any) -> bool:
    """Whether the model's attention goes through transformers' attention interface, in
    which the packed attention is registered; a model that calls SDPA itself (Falcon)
    runs its steps unpacked."""
    module = sys.modules.get(type(model).__module__)
    return module is not None and hasattr(module, "ALL_ATTENTION_FUNCTIONS")


def has_own_eager(model: Any) -> bool:
    """Whether the model's code defines the eager attention ``PACKED_EAGER`` wraps."""
    module = sys.modules.get(type(model).__module__)
    return module is not None and callable(getattr(module, "eager_attention_forward", None))


def _packed(inner_of: Callable[[Any], Attention]) -> Attention:
    """Attention that, while a ``PackedBatch`` is bound, runs ``inner_of(module)`` once
    per row group over the group's own slots; unbound it is that attention alone."""

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        inner = inner_of(module)
        batch: PackedBatch | None = getattr(_bound, "batch", None)
        if batch is None:
            return inner(module, query, key, value, attention_mask, **kwargs)
        # query [1, H, N, hd]; key/value: the layer's whole cache [slots, kv, capacity, hd].
        per_token = query[0].transpose(0, 1)  # [N, H, hd]
        out = per_token.new_empty(per_token.shape[0], per_token.shape[1], value.shape[-1])
        kind = batch.layer_types[module.layer_idx]
        own = batch.own[module.layer_idx] if batch.own is not None else None
        for group in batch.groups:
            if own is not None and takes_own(group.gather.shape[1], group.read_len):
                out[group.tokens] = _own_attention(own, per_token, key, value, group)
                continue
            q = per_token[group.gather].transpose(1, 2)  # [rows, H, T, hd]
            k = key[group.slots, :, : group.read_len]
            v = value[group.slots, :, : group.read_len]
            mask = group.masks[kind] if isinstance(group.masks, dict) else group.masks
            o, _ = inner(module, q, k, v, mask, **kwargs)  # [rows, T, H, hd]
            out[group.gather[group.valid]] = o[group.valid]
        return out.unsqueeze(0), None

    return attention


def takes_own(width: int, read_len: int) -> bool:
    """Whether a group of ``width`` tokens a row, reading ``read_len`` positions, takes
    ``decode_attention`` (where the layers have an ``OwnAttention``)."""
    return width <= OWN_ATTENTION_WIDTH or read_len <= OWN_ATTENTION_READS


def _own_attention(
    own: OwnAttention,
    per_token: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: RowGroup,
) -> torch.Tensor:
    """``group``'s real tokens' attention ``[n, H, hd]`` through ``decode_attention``:
    each token a row, over its own slot of the layer's cache (``key``, ``value``:
    ``[slots, kv, capacity, hd]``), up to its own position."""
    q = per_token[group.tokens].contiguous()  # [n, H, hd]
    o: torch.Tensor = torch.ops.sluice_kernels.decode_attention(
        q, key.unsqueeze(0), value.unsqueeze(0), 0, group.token_positions,
        own.window, own.scale, own.softcap, group.token_slots,
    )  # fmt: skip
    return o.view(q.shape)


AttentionInterface.register(PACKED, _packed(lambda module: sdpa_attention_forward))
AttentionMaskInterface.register(PACKED, sdpa_mask)
AttentionInterface.register(PACKED_EAGER, _packed(_model_eager))
AttentionMaskInterface.register(PACKED_EAGER, eager_mask)


def group(
    slots: slice,
    gather: torch.Tensor,
    valid: torch.Tensor,
    positions: torch.Tensor,
    layout: AttentionLayout,
) -> RowGroup:
    """A group whose rows' queries sit at ``positions`` ``[rows, T]`` of their slots."""
    read_len = int(positions.max().item()) + 1
    rows = torch.arange(slots.start, slots.stop, device=positions.device)
    return RowGroup(
        slots, gather, valid, read_len, layout.masks(positions, read_len),
        tokens=gather[valid],
        token_slots=rows.unsqueeze(1).expand_as(positions)[valid],
        token_positions=positions[valid],
    )  # fmt: skip

"""Per-sequence recurrent state: the cache of state-space (Mamba, Mamba 2), linear
attention (gated delta-net) and short-convolution (LFM2) layers.

Such a layer keeps no keys per position: each sequence carries a fixed-size state
(the last ``kernel`` inputs of its causal convolution, and its SSM or delta-rule
matrix) that every token it runs advances. transformers' layers ask the cache for it
through ``get_conv_state`` / ``update_conv_state`` / ``get_recurrent_state`` /
``update_recurrent_state``, and take their prefill path where ``get_*`` answers None
(no previous state) and their one-token path otherwise.

Here each state is a tensor ``[slots, ...]`` whose row ``s`` is slot ``s``'s: a forward
over the slots ``rows`` reads and writes ``state[rows]`` (a view, so a layer's in-place
one-token update lands in the slot), and a forward whose first position is 0 starts
its rows afresh. So a forward's rows must all start afresh or all go on (the runner
prefills such models one chunk at a time, unpadded, and decodes rows that all have a
state). The tensors are allocated at a layer's first write, in the shapes it writes.

A state sums a sequence's whole past, so it cannot be cut back to a prefix: such a
cache keeps no prefixes for reuse (``reuses_prefixes``) and verifies no drafts (a
rejected draft would leave it advanced).
"""

from __future__ import annotations

from typing import Any

import torch

from .cache_storage import Binding, LayerStorage

# (layer of this storage, state index within the layer)
_Key = tuple[int, int]


class RecurrentStates(LayerStorage):
    """The conv and recurrent states of ``layers`` layers, by slot."""

    reuses_prefixes = False
    holds_state = True

    def __init__(self, *, layers: int, device: torch.device, slots: int) -> None:
        self.layers = layers
        self.device = device
        self._slots = slots
        self.conv: dict[_Key, torch.Tensor] = {}
        self.recurrent: dict[_Key, torch.Tensor] = {}

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.conv.values(), *self.recurrent.values()]

    def bytes_for(self, slots: int, capacity: int) -> int:
        per_slot = sum(t[0].numel() * t.element_size() for t in self._tensors())
        return per_slot * slots

    def resize(self, slots: int, capacity: int) -> None:
        keep = min(slots, self._slots)
        for states in (self.conv, self.recurrent):
            for key, old in states.items():
                new = torch.zeros((slots, *old.shape[1:]), dtype=old.dtype, device=old.device)
                new[:keep] = old[:keep]
                states[key] = new
        self._slots = slots

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        raise AssertionError("a recurrent state cannot be cut back to a prefix")

    def swap(self, a: int, b: int, length: int) -> None:
        for state in self._tensors():
            held = state[a].clone()
            state[a] = state[b]
            state[b] = held

    def update(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, binding: Binding
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError("a recurrent layer has no keys and values to cache")

    def addresses(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self._tensors())

    def snapshot(self) -> Any:
        return [t.clone() for t in self._tensors()]

    def restore(self, snapshot: Any) -> None:
        for state, held in zip(self._tensors(), snapshot, strict=True):
            state.copy_(held)

    def scale_recurrent(self, factor: float) -> bool:
        """Multiply every recurrent (not conv) state; whether there was any (a probe)."""
        for state in self.recurrent.values():
            state.mul_(factor)
        return bool(self.recurrent)

    # ------------------------------------------------------ transformers' state calls

    def get_conv(self, key: _Key, binding: Binding) -> torch.Tensor | None:
        state = self.conv.get(key)
        if state is None or not _goes_on(binding):
            return None
        return state[_rows(binding)]

    def update_conv(
        self, key: _Key, new: torch.Tensor, binding: Binding, kernel: int | None
    ) -> torch.Tensor:
        """Store the last ``kernel`` inputs of the rows' convolution, ``new`` being
        ``[rows, channels, T]``; return what the convolution reads: the previous state
        followed by ``new`` where the rows go on, ``new`` alone where they start."""
        state = self.conv.get(key)
        if state is None:
            width = new.shape[-1] if kernel is None else kernel
            state = torch.zeros(
                (self._slots, *new.shape[1:-1], width), dtype=new.dtype, device=new.device
            )
            self.conv[key] = state
        rows = _rows(binding)
        width = state.shape[-1]
        full = torch.cat([state[rows], new], dim=-1) if _goes_on(binding) else new
        kept = full[..., -width:]
        if kept.shape[-1] < width:  # a prompt shorter than the kernel: zeros before it
            kept = torch.nn.functional.pad(kept, (width - kept.shape[-1], 0))
        state[rows] = kept
        return full

    def get_recurrent(self, key: _Key, binding: Binding) -> torch.Tensor | None:
        state = self.recurrent.get(key)
        if state is None or not _goes_on(binding):
            return None
        return state[_rows(binding)]

    def update_recurrent(self, key: _Key, new: torch.Tensor, binding: Binding) -> torch.Tensor:
        state = self.recurrent.get(key)
        if state is None:
            state = torch.zeros((self._slots, *new.shape[1:]), dtype=new.dtype, device=new.device)
            self.recurrent[key] = state
        rows = _rows(binding)
        state[rows] = new
        return state[rows]


def _rows(binding: Binding) -> slice:
    rows = binding.rows
    if not isinstance(rows, slice):
        raise ValueError("recurrent states are read by consecutive slots (no packed steps)")
    return rows


def _goes_on(binding: Binding) -> bool:
    """Whether the bound rows continue from a state (else they start afresh)."""
    return binding.first_position > 0

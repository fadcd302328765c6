"""A dense, slot-indexed KV cache that transformers' attention layers write into.

Layout: ``[layers, slots, kv_heads, capacity, head_dim]`` for keys and values. Each
running sequence owns one slot; rows of a forward pass map to slots, and each row
has its own positions, so sequences of different lengths share one batched step.
The scheduler keeps decoding sequences in the leading slots ``[0, D)`` so that a
decode step reads the cache through views, never gathers.

transformers' decoder layers call ``cache.update(key, value, layer_idx, kwargs=…)``
and attend over what it returns; that is the only method they need.

Every slot has one position more than ``capacity``: the scratch position, which no
read ever covers. A captured decode step (``cuda_graphs``) has a fixed batch size, and
the rows it pads with write their KV there, harmlessly.
"""

from __future__ import annotations

from typing import Any

import torch


class SlotKVCache:
    def __init__(
        self,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        slots: int,
        capacity: int,
    ) -> None:
        self.layers = layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        shape = (layers, slots, kv_heads, capacity + 1, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Set by ``bind`` for the forward pass about to run.
        self._rows: slice | torch.Tensor | None = slice(0, 0)
        self._row_index = torch.zeros(0, 1, dtype=torch.long, device=device)
        self._positions = torch.zeros(0, 1, dtype=torch.long, device=device)
        self._read_len = 0

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3] - 1

    @property
    def scratch_position(self) -> int:
        """Where padding rows write: beyond every sequence, never read."""
        return self.capacity

    def bytes_for(self, slots: int, capacity: int) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        # The scratch position is allocated too.
        return 2 * self.layers * slots * self.kv_heads * (capacity + 1) * self.head_dim * element

    def resize(self, slots: int, capacity: int) -> None:
        """Grow or shrink, keeping the data of the slots and positions that remain."""
        if slots == self.slots and capacity == self.capacity:
            return
        keep_s, keep_c = min(slots, self.slots), min(capacity, self.capacity)
        shape = (self.layers, slots, self.kv_heads, capacity + 1, self.head_dim)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.zeros(shape, dtype=self.dtype, device=self.device)
            new[:, :keep_s, :, :keep_c] = old[:, :keep_s, :, :keep_c]
            setattr(self, name, new)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Make slot ``dst`` start with the first ``length`` positions of slot ``src``."""
        if length > 0 and src != dst:
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def swap(self, a: int, b: int, length: int) -> None:
        """Exchange the first ``length`` positions of two slots."""
        if a == b or length <= 0:
            return
        for cache in (self.k, self.v):
            held = cache[:, a, :, :length].clone()
            cache[:, a, :, :length] = cache[:, b, :, :length]
            cache[:, b, :, :length] = held

    def bind(self, rows: slice | torch.Tensor, positions: torch.Tensor) -> int:
        """Prepare the next forward: row ``r`` writes its tokens at ``positions[r]``.

        Returns how many positions of each slot the forward reads (the masks, built by
        ``attention.AttentionLayout``, cover that many keys).
        """
        n_rows = positions.shape[0]
        if isinstance(rows, slice):
            start = rows.start or 0
            index = torch.arange(start, start + n_rows, device=self.device)
        else:
            index = rows
        self._rows = rows
        self._row_index = index.unsqueeze(1)
        self._positions = positions
        self._read_len = int(positions.max().item()) + 1
        return self._read_len

    def bind_static(self, write_rows: torch.Tensor, positions: torch.Tensor, read_len: int) -> None:
        """Prepare a forward whose shapes do not depend on the data (a captured graph).

        Row ``r`` writes its one token into slot ``write_rows[r]`` at ``positions[r]``
        (both ``[rows, 1]`` tensors the caller refills between replays), and every row
        reads the first ``read_len`` positions of slot ``r``. The caller builds the mask.
        """
        self._rows = slice(0, positions.shape[0])
        self._row_index = write_rows
        self._positions = positions
        self._read_len = read_len

    def bind_packed(self, write_slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Prepare a packed forward (``packed``): token ``i`` of the one packed row writes
        into slot ``write_slots[i]`` at ``positions[i]`` (both ``[N]``), and every layer
        gets its whole cache back, from which the packed attention reads each group's
        slots."""
        self._rows = None
        self._row_index = write_slots.view(1, -1)
        self._positions = positions.view(1, -1)

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k_layer, v_layer = self.k[layer_idx], self.v[layer_idx]
        # [rows, kv, T, hd] → [rows, T, kv, hd] to match the advanced-index layout.
        k_layer[self._row_index, :, self._positions] = key_states.transpose(1, 2)
        v_layer[self._row_index, :, self._positions] = value_states.transpose(1, 2)
        if self._rows is None:
            return k_layer, v_layer
        length = self._read_len
        if isinstance(self._rows, slice):
            return k_layer[self._rows, :, :length], v_layer[self._rows, :, :length]
        rows = self._rows
        return k_layer[rows, :, :length], v_layer[rows, :, :length]

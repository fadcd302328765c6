"""The slot cache that transformers' decoder layers write into: one slot per running
sequence, each layer's part held by the storage its layer kind chose (``layer_kinds``).

Each running sequence owns one slot; rows of a forward pass map to slots, and each
row has its own positions, so sequences of different lengths share one batched step.
The scheduler keeps decoding sequences in the leading slots ``[0, D)`` so that a
decode step reads the cache through views, never gathers. The slot table grows,
copies and swaps slots through ``SlotKVCache``, which asks each storage; it never
sees a layout. ``DenseKV`` is the layout of attention layers: ``[layers, slots,
kv_heads, capacity, head_dim]`` for keys and for values.

transformers' attention layers call ``cache.update(key, value, layer_idx, kwargs=…)``
and attend over what it returns; that is the only method they need. Recurrent layers
(state-space, linear attention, short convolutions) call ``get_conv_state`` /
``update_conv_state`` / ``get_recurrent_state`` / ``update_recurrent_state`` instead,
which their storage answers (``recurrent_state``). Some models' forwards also ask
``get_seq_length()``, which one number answers only for rows that start together
(see there).

Every slot has one position more than ``capacity``: the scratch position, which no
read ever covers. A captured decode step (``cuda_graphs``) has a fixed batch size, and
the rows it pads with write their KV there, harmlessly.

Inside a compiled step (``compiled_step``) the write is the custom op ``sluice::write_kv``,
which declares that it mutates the cache: written as indexing, inductor would
functionalise it into a copy of the whole cache every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .cache_storage import Binding, LayerStorage
from .recurrent_state import RecurrentStates


def write_kv(
    keys: torch.Tensor,
    values: torch.Tensor,
    layer: int,
    rows: torch.Tensor,
    positions: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Row ``r``'s ``key`` / ``value`` ``[rows, kv, T, hd]`` into slot ``rows[r]`` of
    ``layer`` of the cache ``[layers, slots, kv, capacity + 1, hd]`` at ``positions[r]``,
    in place. (The op takes the whole cache and the layer, not the layer's view: a
    compiled step that mutates views of a cache with dynamic sizes loses their offsets,
    and every layer wrote layer 0.)"""
    # [rows, kv, T, hd] → [rows, T, kv, hd] to match the advanced-index layout.
    keys[layer][rows, :, positions] = key.transpose(1, 2)
    values[layer][rows, :, positions] = value.transpose(1, 2)


_write_kv_op = torch.library.custom_op("sluice::write_kv", mutates_args=("keys", "values"))(
    write_kv
)


@_write_kv_op.register_fake
def _writes_in_place(*args: object) -> None:
    """What the op returns while tracing: nothing (its effect is the mutation)."""


class DenseKV(LayerStorage):
    """Keys and values of every position, ``[layers, slots, kv_heads, capacity + 1,
    width]``: full, sliding-window and chunked attention layers. The two widths may
    differ: an MLA layer (DeepSeek-V2/V3, MiniCPM3) writes its compressed latent, one
    "head" ``kv_lora_rank`` wide as the key and its shared rotary key as the value, and
    expands them to every head's keys and values after reading."""

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
        value_dim: int | None = None,
    ) -> None:
        self.layers = layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.value_dim = head_dim if value_dim is None else value_dim
        self.dtype = dtype
        self.device = device
        self.k = torch.zeros(self._shape("k", slots, capacity), dtype=dtype, device=device)
        self.v = torch.zeros(self._shape("v", slots, capacity), dtype=dtype, device=device)

    def _shape(self, name: str, slots: int, capacity: int) -> tuple[int, ...]:
        width = self.head_dim if name == "k" else self.value_dim
        return (self.layers, slots, self.kv_heads, capacity + 1, width)

    def bytes_for(self, slots: int, capacity: int) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        # The scratch position is allocated too.
        width = self.head_dim + self.value_dim
        return self.layers * slots * self.kv_heads * (capacity + 1) * width * element

    def resize(self, slots: int, capacity: int) -> None:
        old_slots, old_capacity = self.k.shape[1], self.k.shape[3] - 1
        keep_s, keep_c = min(slots, old_slots), min(capacity, old_capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.zeros(
                self._shape(name, slots, capacity), dtype=self.dtype, device=self.device
            )
            new[:, :keep_s, :, :keep_c] = old[:, :keep_s, :, :keep_c]
            setattr(self, name, new)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def swap(self, a: int, b: int, length: int) -> None:
        for cache in (self.k, self.v):
            held = cache[:, a, :, :length].clone()
            cache[:, a, :, :length] = cache[:, b, :, :length]
            cache[:, b, :, :length] = held

    def update(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, binding: Binding
    ) -> tuple[torch.Tensor, torch.Tensor]:
        where = (layer, binding.row_index, binding.positions, key, value)
        if torch.compiler.is_compiling():
            torch.ops.sluice.write_kv(self.k, self.v, *where)
        else:  # the op's own body, without its dispatch (tens of µs a layer)
            write_kv(self.k, self.v, *where)
        k_layer, v_layer = self.k[layer], self.v[layer]
        rows = binding.rows
        if rows is None:
            return k_layer, v_layer
        length = binding.read_len
        return k_layer[rows, :, :length], v_layer[rows, :, :length]

    def addresses(self) -> tuple[int, ...]:
        return (self.k.data_ptr(), self.v.data_ptr())


class SlotKVCache:
    """Every layer's cache, by slot: ``groups`` are (layers, the storage holding them)."""

    def __init__(
        self,
        groups: Sequence[tuple[Sequence[int], LayerStorage]],
        *,
        dtype: torch.dtype,
        device: torch.device,
        slots: int,
        capacity: int,
    ) -> None:
        self.dtype = dtype
        self.device = device
        self.storages = [storage for _, storage in groups]
        # Layer index → (its storage, its index there).
        self._layers: dict[int, tuple[LayerStorage, int]] = {
            layer: (storage, i) for layers, storage in groups for i, layer in enumerate(layers)
        }
        self._slots, self._capacity = slots, capacity
        # Set by ``bind*`` for the forward pass about to run.
        self._binding = Binding(
            slice(0, 0),
            torch.zeros(0, 1, dtype=torch.long, device=device),
            torch.zeros(0, 1, dtype=torch.long, device=device),
            0,
        )

    @classmethod
    def dense(
        cls,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        slots: int,
        capacity: int,
    ) -> SlotKVCache:
        """Every layer in one dense key/value storage."""
        storage = DenseKV(
            layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device,
            slots=slots, capacity=capacity,
        )  # fmt: skip
        return cls([(range(layers), storage)], dtype=dtype, device=device, slots=slots,
                   capacity=capacity)  # fmt: skip

    @property
    def slots(self) -> int:
        return self._slots

    def layer_storage(self, layer_idx: int) -> tuple[LayerStorage, int]:
        """The storage holding layer ``layer_idx``, and the layer's index there."""
        return self._layers[layer_idx]

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def scratch_position(self) -> int:
        """Where padding rows write: beyond every sequence, never read."""
        return self.capacity

    def addresses(self) -> tuple[int, ...]:
        return tuple(a for storage in self.storages for a in storage.addresses())

    @property
    def reuses_prefixes(self) -> bool:
        return all(storage.reuses_prefixes for storage in self.storages)

    @property
    def holds_state(self) -> bool:
        """Whether some layers carry a per-sequence state that each forward advances
        (``recurrent_state``), rather than keys written per position."""
        return any(storage.holds_state for storage in self.storages)

    def snapshot(self) -> list[Any]:
        return [storage.snapshot() for storage in self.storages]

    def restore(self, snapshot: list[Any]) -> None:
        for storage, held in zip(self.storages, snapshot, strict=True):
            storage.restore(held)

    def scale_recurrent_states(self, factor: float) -> bool:
        """Multiply every recurrent state (a self-check's probe); whether there was any."""
        scaled = [
            s.scale_recurrent(factor) for s in self.storages if isinstance(s, RecurrentStates)
        ]
        return any(scaled)

    def bytes_for(self, slots: int, capacity: int) -> int:
        return sum(storage.bytes_for(slots, capacity) for storage in self.storages)

    def resize(self, slots: int, capacity: int) -> None:
        """Grow or shrink, keeping the data of the slots and positions that remain."""
        if slots == self.slots and capacity == self.capacity:
            return
        for storage in self.storages:
            storage.resize(slots, capacity)
        self._slots, self._capacity = slots, capacity

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Make slot ``dst`` start with the first ``length`` positions of slot ``src``."""
        if length > 0 and src != dst:
            for storage in self.storages:
                storage.copy_prefix(src, dst, length)

    def swap(self, a: int, b: int, length: int) -> None:
        """Exchange the first ``length`` positions of two slots."""
        if a == b or length <= 0:
            return
        for storage in self.storages:
            storage.swap(a, b, length)

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
        first, last = (int(p) for p in torch.stack(torch.aminmax(positions)).tolist())
        if self.holds_state and first == 0 and bool((positions[:, 0] > 0).any()):
            raise ValueError("rows that start afresh and rows that go on in one forward")
        self._binding = Binding(rows, index.unsqueeze(1), positions, last + 1, first)
        return last + 1

    def bind_static(self, write_rows: torch.Tensor, positions: torch.Tensor, read_len: int) -> None:
        """Prepare a forward whose shapes do not depend on the data (a captured graph).

        Row ``r`` writes its one token into slot ``write_rows[r]`` at ``positions[r]``
        (both ``[rows, 1]`` tensors the caller refills between replays), and every row
        reads the first ``read_len`` positions of slot ``r``. The caller builds the mask.
        """
        self._binding = Binding(slice(0, positions.shape[0]), write_rows, positions, read_len)

    def bind_packed(
        self, write_slots: torch.Tensor, positions: torch.Tensor, first_position: int
    ) -> None:
        """Prepare a packed forward (``packed``): token ``i`` of the one packed row writes
        into slot ``write_slots[i]`` at ``positions[i]`` (both ``[N]``), and every layer
        gets its whole cache back, from which the packed attention reads each group's
        slots."""
        self._binding = Binding(
            None, write_slots.view(1, -1), positions.view(1, -1), 0, first_position
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """transformers' "positions cached before this forward", for the models whose
        forward asks (Falcon, BioGPT, Llama 4): the first position the forward writes.
        Rows of a step start at different positions, so no one number is right for all
        of them; these models use it only where Sluice passes what it would decide
        (``position_ids``, a 4-D mask). A model that used it for more would give one of
        the runner's self-check's two rows (``model_runner.self_check``, started at
        different positions) wrong logits and be refused."""
        return self._binding.first_position

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        storage, layer = self._layers[layer_idx]
        return storage.update(layer, key_states, value_states, self._binding)

    # ------------------------------------- the state calls of recurrent layers

    def _state_of(self, layer_idx: int) -> tuple[RecurrentStates, int]:
        storage, layer = self._layers[layer_idx]
        if not isinstance(storage, RecurrentStates):
            raise ValueError(f"layer {layer_idx} holds no recurrent state")
        return storage, layer

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        storage, layer = self._state_of(layer_idx)
        return storage.get_conv((layer, state_idx), self._binding)

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        storage, layer = self._state_of(layer_idx)
        return storage.update_conv((layer, state_idx), conv_states, self._binding, conv_kernel_size)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        storage, layer = self._state_of(layer_idx)
        return storage.get_recurrent((layer, state_idx), self._binding)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        storage, layer = self._state_of(layer_idx)
        return storage.update_recurrent((layer, state_idx), recurrent_states, self._binding)

    def has_previous_state(
        self, layer_idx: int | None = None, state_idx: int | None = None
    ) -> bool:
        return self._binding.first_position > 0

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        return False  # states are never cropped back (no drafts for these models)

"""What a layer kind's cache is to the slot cache (``kv_cache.SlotKVCache``): a
``LayerStorage`` holds some layers' state for every slot and grows, copies and swaps
it; a ``Binding`` says where the forward about to run writes and what it reads.
``NoState`` is the storage of layers that keep nothing."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass
class Binding:
    """Where the forward about to run writes and what it reads (set by ``bind*``)."""

    # The slots the rows read (a slice: the leading decode region; None: every slot).
    rows: slice | torch.Tensor | None
    row_index: torch.Tensor  # [rows, 1] (or [1, N] packed): the slot each token writes
    positions: torch.Tensor  # [rows, T] (or [1, N] packed): the position it writes at
    read_len: int  # positions of each slot read
    # The first position written (``get_seq_length``); 0 where the host does not know it.
    first_position: int = 0


class LayerStorage(ABC):
    """How some layers hold each slot's state: the layout a layer kind chose."""

    # Whether a slot's first positions can be copied to start another sequence.
    reuses_prefixes: ClassVar[bool] = True
    # Whether it holds a per-sequence state each forward advances (not keys by position).
    holds_state: ClassVar[bool] = False

    @abstractmethod
    def bytes_for(self, slots: int, capacity: int) -> int: ...

    @abstractmethod
    def resize(self, slots: int, capacity: int) -> None:
        """Grow or shrink, keeping the data of the slots and positions that remain."""

    @abstractmethod
    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Make slot ``dst`` start with the first ``length`` positions of slot ``src``."""

    @abstractmethod
    def swap(self, a: int, b: int, length: int) -> None:
        """Exchange the first ``length`` positions of two slots."""

    @abstractmethod
    def update(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, binding: Binding
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer ``layer`` (of this storage's) for the bound forward; return what
        its attention reads."""

    @abstractmethod
    def addresses(self) -> tuple[int, ...]:
        """Where its tensors live (a captured graph holds these addresses)."""

    def snapshot(self) -> Any:
        """What ``restore`` needs to undo the forwards run after it. None here: a
        storage by position is rewritten the same by a forward run again."""
        return None

    def restore(self, snapshot: Any) -> None:
        """Put back what ``snapshot`` held (nothing to put back here)."""
        return None


class NoState(LayerStorage):
    """The cache of layers that keep nothing per sequence (Nemotron-H's MLP and MoE
    blocks, which its ``layer_types`` list beside the mixers)."""

    def bytes_for(self, slots: int, capacity: int) -> int:
        return 0

    def resize(self, slots: int, capacity: int) -> None:
        pass

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        pass

    def swap(self, a: int, b: int, length: int) -> None:
        pass

    def update(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, binding: Binding
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError("a layer without a cache was asked to cache keys and values")

    def addresses(self) -> tuple[int, ...]:
        return ()

"""The per-slot recurrent state (``engine/recurrent_state.py``) as transformers' mixers
call it, with no model: what a forward that starts afresh or goes on reads and
keeps, and how slot moves carry it."""

from __future__ import annotations

import random

import pytest
import torch

from sluice.engine.kv_cache import SlotKVCache
from sluice.engine.params import SamplingParams, SequenceSpec
from sluice.engine.recurrent_state import RecurrentStates
from sluice.engine.sampler import RowState
from sluice.engine.sequence import Sequence
from sluice.engine.slots import SlotTable

KERNEL = 3
CHANNELS = 2


def cache(slots: int = 3) -> SlotKVCache:
    storage = RecurrentStates(layers=1, device=torch.device("cpu"), slots=slots)
    return SlotKVCache(
        [((0,), storage)],
        dtype=torch.float32,
        device=torch.device("cpu"),
        slots=slots,
        capacity=16,
    )


def bind(c: SlotKVCache, first_slot: int, starts: list[int], width: int) -> None:
    positions = torch.stack([torch.arange(s, s + width) for s in starts])
    c.bind(slice(first_slot, first_slot + len(starts)), positions)


def inputs(rows: int, width: int, offset: float = 0.0) -> torch.Tensor:
    """``[rows, CHANNELS, width]`` conv inputs numbered so every value is distinct."""
    return (
        torch.arange(rows * CHANNELS * width, dtype=torch.float32).view(rows, CHANNELS, width)
        + offset
    )


def test_a_forward_from_position_0_starts_afresh_and_keeps_the_last_kernel_inputs() -> None:
    c = cache()
    bind(c, 1, [0], 5)
    assert c.get_conv_state(0) is None and c.get_recurrent_state(0) is None
    assert not c.has_previous_state(0)
    new = inputs(1, 5)
    assert torch.equal(c.update_conv_state(new, 0, conv_kernel_size=KERNEL), new)
    bind(c, 1, [5], 1)
    assert c.has_previous_state(0)
    state = c.get_conv_state(0)
    assert state is not None and torch.equal(state, new[..., -KERNEL:])


def test_a_prompt_shorter_than_the_kernel_is_kept_after_zeros() -> None:
    c = cache()
    bind(c, 0, [0], 2)
    c.update_conv_state(inputs(1, 2), 0, conv_kernel_size=KERNEL)
    bind(c, 0, [2], 1)
    state = c.get_conv_state(0)
    assert state is not None
    assert torch.equal(state[..., 0], torch.zeros(1, CHANNELS))
    assert torch.equal(state[..., 1:], inputs(1, 2))


def test_a_chunk_that_goes_on_reads_its_state_before_the_new_inputs() -> None:
    c = cache()
    bind(c, 0, [0], 4)
    first = inputs(1, 4)
    c.update_conv_state(first, 0, conv_kernel_size=KERNEL)
    bind(c, 0, [4], 2)
    second = inputs(1, 2, offset=100.0)
    full = c.update_conv_state(second, 0, conv_kernel_size=KERNEL)
    assert torch.equal(full, torch.cat([first[..., -KERNEL:], second], dim=-1))
    bind(c, 0, [6], 1)
    state = c.get_conv_state(0)
    assert state is not None and torch.equal(state, full[..., -KERNEL:])


def test_rows_read_their_own_slots_and_an_in_place_update_lands_there() -> None:
    c = cache()
    bind(c, 0, [0, 0], 3)
    c.update_recurrent_state(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 0)
    bind(c, 0, [3, 3], 1)
    state = c.get_recurrent_state(0)
    assert state is not None and state.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    state.mul_(10)  # a mixer's one-token update writes through the view
    bind(c, 1, [4], 1)
    assert c.get_recurrent_state(0).tolist() == [[30.0, 40.0]]  # type: ignore[union-attr]


def test_rows_that_start_and_rows_that_go_on_never_share_a_forward() -> None:
    c = cache()
    positions = torch.tensor([[0, 1], [5, 6]])
    with pytest.raises(ValueError, match="start afresh"):
        c.bind(slice(0, 2), positions)


def test_slot_moves_carry_whole_states_and_a_prefix_is_never_copied() -> None:
    c = cache(slots=2)
    bind(c, 0, [0, 0], 3)
    c.update_recurrent_state(torch.tensor([[1.0], [2.0]]), 0)
    c.swap(0, 1, 3)
    c.resize(3, 16)
    bind(c, 0, [3, 3], 1)
    assert c.get_recurrent_state(0).tolist() == [[2.0], [1.0]]  # type: ignore[union-attr]
    assert c.bytes_for(5, 16) == 5 * 4  # one float per slot, whatever the capacity
    with pytest.raises(AssertionError):
        c.storages[0].copy_prefix(0, 1, 2)


def test_the_slot_table_reuses_no_prefix_of_a_recurrent_cache() -> None:
    c = cache()
    table = SlotTable(c)
    params = SamplingParams(temperature=0.0, max_tokens=4)

    def sequence(prompt: tuple[int, ...]) -> Sequence:
        spec = SequenceSpec("r", 0, prompt, params)
        row = RowState(params=params, rng=random.Random(0), prompt=prompt)
        return Sequence(spec=spec, sink=lambda _: None, row=row)

    first = sequence((5, 6, 7, 8))
    table.place(first)
    first.kv_len = 4
    table.promote(first)
    table.release(first)
    again = sequence((5, 6, 7, 8, 9))
    table.place(again)
    assert again.cached_tokens == 0 and again.kv_len == 0

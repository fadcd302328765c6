"""``decode_attention`` (engine/kernels/decode_ops.cpp) against attention written out in
float64: one query token a row over its slot's cached keys, grouped query heads, an
optional sliding window and score soft-cap. Head widths that are not a multiple of the
kernel's lanes (eight, or sixteen with AVX-512, whose values are summed 64 wide) take
its narrower passes and scalar tail; groups of more than four heads take more than one
pass over a key."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_gguf_blocks import own_kernel

LAYERS, POSITIONS = 2, 40


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    own_kernel()


def reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layer: int,
    positions: list[int],
    window: int,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    rows, heads, dim = q.shape
    kv_heads = keys.shape[2]
    group = heads // kv_heads
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    for r, last in enumerate(positions):
        first = max(0, last - window + 1) if window > 0 else 0
        for head in range(heads):
            k = keys[layer, r, head // group, first : last + 1].double()
            v = values[layer, r, head // group, first : last + 1].double()
            scores = k @ q[r, head].double() * scale
            if softcap > 0:
                scores = torch.tanh(scores / softcap) * softcap
            out[r, head] = torch.softmax(scores, 0) @ v
    return out.reshape(rows, heads * dim)


# (heads, kv heads, head width): Gemma 3's 4 / 1 / 256, SmolLM2's 9 / 3 / 64, and widths
# with 16-wide and scalar remainders past the 64-wide blocks.
SHAPES = [(4, 1, 16), (9, 3, 12), (10, 2, 8), (4, 1, 256), (9, 3, 64), (5, 1, 88), (3, 3, 200)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-10}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), SHAPES)
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (7, 0.0), (0, 3.0)])
def test_decode_attention_is_attention(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, window: int, softcap: float
) -> None:
    generator = torch.Generator().manual_seed(heads * dim + window)
    rows = 3
    shape = (LAYERS, rows, kv_heads, POSITIONS, dim)
    keys = torch.randn(shape, generator=generator).to(dtype)
    values = torch.randn(shape, generator=generator).to(dtype)
    q = torch.randn(rows, heads, dim, generator=generator).to(dtype)
    positions = [0, 17, POSITIONS - 1]
    scale = dim**-0.5
    got = torch.ops.sluice_kernels.decode_attention(
        q, keys, values, 1, torch.tensor(positions), window, scale, softcap
    )
    expected = reference(q, keys, values, 1, positions, window, scale, softcap)
    assert got.dtype == dtype and got.shape == (rows, heads * dim)
    # float32 arithmetic, then the result rounded to the cache's dtype
    tolerance = TOLERANCE[dtype]
    assert torch.allclose(got.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("window", [0, 5])
def test_rows_read_the_slots_they_are_given(window: int) -> None:
    """With ``slots``, row r reads slot ``slots[r]``: a packed step's prompt tokens, each
    a row at its own position of the slot they share, get causal attention over it."""
    generator = torch.Generator().manual_seed(7 + window)
    heads, kv_heads, dim = 9, 3, 64
    shape = (LAYERS, 4, kv_heads, POSITIONS, dim)
    keys = torch.randn(shape, generator=generator)
    values = torch.randn(shape, generator=generator)
    slots = [2, 2, 2, 0, 3, 2]
    positions = [0, 1, 9, 17, 3, POSITIONS - 1]
    q = torch.randn(len(slots), heads, dim, generator=generator)
    scale = dim**-0.5
    got = torch.ops.sluice_kernels.decode_attention(
        q, keys, values, 0, torch.tensor(positions), window, scale, 0.0, torch.tensor(slots)
    )
    # Each row alone, in slot 0 of a cache holding only its slot.
    for r, (slot, position) in enumerate(zip(slots, positions, strict=True)):
        alone = reference(
            q[r : r + 1], keys[:, slot : slot + 1], values[:, slot : slot + 1], 0,
            [position], window, scale, 0.0,
        )  # fmt: skip
        assert torch.allclose(got[r : r + 1].double(), alone, rtol=1e-5, atol=1e-5), r


@pytest.mark.parametrize(
    ("slots", "positions", "message"),
    [([0, 4], [1, 1], "a slot past the cache"), ([0, 1], [1, POSITIONS], "a position past")],
)
def test_slots_and_positions_past_the_cache_are_refused(
    slots: list[int], positions: list[int], message: str
) -> None:
    keys = torch.zeros(LAYERS, 4, 1, POSITIONS, 8)
    q = torch.zeros(2, 2, 8)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.sluice_kernels.decode_attention(
            q, keys, keys, 0, torch.tensor(positions), 0, 1.0, 0.0, torch.tensor(slots)
        )

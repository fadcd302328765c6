"""The decode step's row ops (engine/kernels/decode_ops.cpp) on one thread and two, in
inference mode as the server runs them. The residual norm and rotary with the cache
write split their rows across threads, each row computed alone and in the same order, so
two threads give one thread's results bit for bit, at a decode step's 64 rows and at the
few rows that stay on one thread; the gated activation is ATen's, element by element."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.unit.test_gguf_blocks import own_kernel

OPS = torch.ops.sluice_kernels
WIDTH, HEADS, KV_HEADS, DIM, POSITIONS = 640, 4, 1, 256, 96


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    own_kernel()


def on_one_and_two_threads(run: Callable[[], tuple[torch.Tensor, ...]]) -> None:
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(2)
            two = run()
            torch.set_num_threads(1)
            one = run()
    finally:
        torch.set_num_threads(threads)
    assert len(one) == len(two)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("delta", ["none", "added", "normalised"])
def test_residual_norm_on_any_threads(dtype: torch.dtype, rows: int, delta: str) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, WIDTH, generator=g).to(dtype)
    d = torch.randn(rows, WIDTH, generator=g).to(dtype) if delta != "none" else None
    dw = torch.rand(WIDTH, generator=g) + 0.5 if delta == "normalised" else None
    weight = torch.rand(WIDTH, generator=g) + 0.5

    def run() -> tuple[torch.Tensor, ...]:
        residual = x.clone()
        out = OPS.rms_norm_residual(residual, d, dw, weight, 1e-6)
        return out, residual

    on_one_and_two_threads(run)
    out, residual = (
        run()
    )  # the residual, updated in place where a delta is added, is what is normalised
    assert torch.equal(residual, x) == (d is None)
    ref = residual.float() * torch.rsqrt(residual.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out.float(), ref * weight, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("norms", [False, True])
def test_rotary_and_cache_write_on_any_threads(dtype: torch.dtype, rows: int, norms: bool) -> None:
    g = torch.Generator().manual_seed(rows + 7)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * DIM, generator=g).to(dtype)
    positions = torch.randint(0, POSITIONS, (rows,), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM))
    q_norm = torch.rand(DIM, generator=g) + 0.5 if norms else None
    k_norm = torch.rand(DIM, generator=g) + 0.5 if norms else None

    def run() -> tuple[torch.Tensor, ...]:
        keys = torch.zeros(2, rows, KV_HEADS, POSITIONS, DIM, dtype=dtype)
        values = torch.zeros_like(keys)
        q = OPS.rope_kv(
            qkv, positions, inv_freq, 1.0, q_norm, k_norm, 1e-6, keys, values, 1, HEADS, KV_HEADS
        )
        return q, keys, values

    on_one_and_two_threads(run)
    _, keys, values = run()
    width = (HEADS + KV_HEADS) * DIM
    for r, p in enumerate(positions.tolist()):  # each row's value lands in its own slot
        assert torch.equal(values[1, r, :, p], qkv[r, width:].reshape(KV_HEADS, DIM))
    assert keys[0].count_nonzero() == 0 and values[0].count_nonzero() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 64])
@pytest.mark.parametrize("act", [0, 1])
def test_gated_activation_on_any_threads(dtype: torch.dtype, rows: int, act: int) -> None:
    gate_up = torch.randn(rows, 2 * 2048, generator=torch.Generator().manual_seed(rows))
    on_one_and_two_threads(lambda: (OPS.gated_act(gate_up, act, dtype),))
    both = gate_up.to(dtype)
    gate, up = both[:, :2048], both[:, 2048:]
    expected = (
        torch.nn.functional.silu(gate)
        if act == 0
        else torch.nn.functional.gelu(gate, approximate="tanh")
    ) * up
    assert torch.equal(OPS.gated_act(gate_up, act, dtype), expected)

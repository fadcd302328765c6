"""The packed CPU kernels ``bench/packed_kernels.py`` times compute what a GGUF block
means: int4 with group 32 is ``(q − 8) × scale + zero`` per block of 32 inputs (so a
Q4_1 block, ``d × q + m``, is ``scale = d``, ``zero = m + 8d``), int8 is one scale per
output channel; and the bench's step runs every kernel."""

from __future__ import annotations

import torch

from sluice.bench.packed_kernels import GROUP, KERNELS, step_times


def test_int4_group_32_is_a_q4_1_block() -> None:
    torch.manual_seed(0)
    n, k = 48, 96
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    d = torch.rand(k // GROUP, n) / 10
    m = torch.randn(k // GROUP, n) / 10
    scales_zeros = torch.stack([d, m + 8 * d], dim=-1).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)
    x = torch.randn(3, k).to(torch.bfloat16)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)
    # Each block's scale and zero spread over its 32 inputs: [n, k].
    scale, zero = (t.repeat_interleave(GROUP, dim=0).T for t in scales_zeros.float().unbind(-1))
    weight = (q.float() - 8) * scale + zero
    want = x.float() @ weight.T
    assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2)  # bf16 activations


def test_int8_is_one_scale_per_output_channel() -> None:
    torch.manual_seed(1)
    w = torch.randint(-127, 128, (40, 64), dtype=torch.int8)
    scales = torch.rand(40).to(torch.bfloat16)
    x = torch.randn(2, 64).to(torch.bfloat16)
    got = torch.ops.aten._weight_int8pack_mm(x, w, scales)
    want = x.float() @ (w.float() * scales.float()[:, None]).T
    assert torch.allclose(got.float(), want, rtol=2e-2, atol=5e-1)


def test_a_step_times_every_kernel() -> None:
    total = step_times(((64, 64, 2), (32, 64, 1)), rows=2, repeats=1)
    assert set(total) == set(KERNELS) and all(t > 0 for t in total.values())

"""Int8 weights and activations on the CPU: SGLang's ``--quantization w8a8_int8``.

Each linear of the decoder keeps its weight as int8 with one scale per output channel;
its input is quantised per row (per token) when it arrives, the product runs as an
int8 GEMM with int32 accumulation (``torch._int_mm``, VNNI on x86), and the result is
scaled back. The decoder's weights are read as a quarter of their fp32 bytes and
multiplied in int8: on SmolLM2-135M (2 cores, AVX-512 VNNI) a decode step is ×1.4
faster at 1 to 64 rows and a 512-token prefill chunk ×1.7, for a perplexity ×1.17
(docs/benchmarks.md).

Across the batch: a row's int8 input depends on that row alone, and integer sums do
not depend on their order, so a request's projections are bit-identical whatever else
is in the step. Attention is not (a padded batch sums in another order, in the last
bit), and int8 rounding now and then turns such a bit into a visible difference: a
request's logprobs can move by up to a few tenths and its greedy text can part at a
near-tie, where fp32 stays within ~1e-6 (``tests/e2e/test_e2e_quantization.py``). The
quality cost against the unquantised model, and that agreement, are measured by
``bench/quantization.py``.

Kept in full precision, as SGLang keeps them: the LM head (its logits are the
logprobs users read) and MoE routers (expert choice is discrete, a small error flips
it). The projections transformers applies to one input (q/k/v, gate/up) share one
GEMM over their concatenated weights (``engine/fused_projections.py``): one
quantisation of the input, one larger multiply.
"""

from __future__ import annotations

import torch
from torch import nn

from .fused_projections import SharedProjections

# The MLP's down projection is quantised like the rest, although its input carries
# outlier channels that per-token int8 holds poorly. Kept in full precision,
# SmolLM2-135M's perplexity cost fell from ×1.17 to ×1.02, but a step was 10–30 %
# slower and a busy batch parted from the alone tokens far more often (fp32's GEMM
# sums differ with the batch's rows, and the next int8 rounding amplifies that);
# docs/benchmarks.md.
_INT8_MAX = 127.0
# ``_int_mm`` sums K products of two int8 values in int32: K * 127² must stay below 2³¹.
MAX_IN_FEATURES = (2**31 - 1) // (127 * 127)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of a 2-D tensor: (values, float32 scale per row [M, 1])."""
    # abs + amax: 7× faster than ``vector_norm(ord=inf)`` at 64 rows on the CPU.
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min_(1e-12).div_(_INT8_MAX)
    return x.mul(scale.reciprocal()).round_().to(torch.int8), scale


def quantize_channels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel of an [N, K] weight: (values, scale [N])."""
    values, scale = quantize_rows(weight.detach().float())
    return values, scale.squeeze(1)


class Int8Projections(SharedProjections):
    """Int8 weights per output channel, the input quantised per row, an int8 GEMM."""

    method = "w8a8_int8"

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__(linears)
        weights = [quantize_channels(linear.weight) for linear in linears]
        self.weight = torch.cat([w for w, _ in weights])  # [N_total, K] int8
        self.scale = torch.cat([s for _, s in weights])  # [N_total] float32

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        values, row_scale = quantize_rows(rows)
        product = torch._int_mm(values, self.weight.t())
        return (product * row_scale).mul_(self.scale)

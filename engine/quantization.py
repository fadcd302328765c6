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
GEMM over their concatenated weights: one quantisation of the input, one larger
multiply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .errors import ModelLoadError

QUANTIZATION_METHODS = ("w8a8_int8",)

# Sibling projections that transformers' decoder layers apply to the same tensor.
_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# Linears that pick experts: left in full precision (a discrete choice that a small
# error flips).
#
# The MLP's down projection is quantised like the rest, although its input carries
# outlier channels that per-token int8 holds poorly. Kept in full precision,
# SmolLM2-135M's perplexity cost fell from ×1.17 to ×1.02, but a step was 10–30 %
# slower and a busy batch parted from the alone tokens far more often (fp32's GEMM
# sums differ with the batch's rows, and the next int8 rounding amplifies that);
# docs/benchmarks.md.
_ROUTERS = frozenset({"gate", "router"})
_INT8_MAX = 127.0
# ``_int_mm`` sums K products of two int8 values in int32: K * 127² must stay below 2³¹.
_MAX_IN_FEATURES = (2**31 - 1) // (127 * 127)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of a 2-D tensor: (values, float32 scale per row [M, 1])."""
    # abs + amax: 7× faster than ``vector_norm(ord=inf)`` at 64 rows on the CPU.
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min_(1e-12).div_(_INT8_MAX)
    return x.mul(scale.reciprocal()).round_().to(torch.int8), scale


def quantize_channels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel of an [N, K] weight: (values, scale [N])."""
    values, scale = quantize_rows(weight.detach().float())
    return values, scale.squeeze(1)


class Int8Projections:
    """One int8 GEMM over the concatenated weights of projections that read one input.

    The first member called with an input computes every member's output; the others,
    called with that same tensor (transformers passes one object to q, k and v), take
    theirs without multiplying again. Called with another tensor, a member recomputes:
    slower, never wrong."""

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        weights = [quantize_channels(linear.weight) for linear in linears]
        self.weight = torch.cat([w for w, _ in weights])  # [N_total, K] int8
        self.scale = torch.cat([s for _, s in weights])  # [N_total] float32
        widths = [linear.out_features for linear in linears]
        self.bounds = [(sum(widths[:i]), sum(widths[: i + 1])) for i in range(len(widths))]
        biases = [linear.bias for linear in linears]
        self.bias = (
            None
            if all(b is None for b in biases)
            else torch.cat(
                [
                    b.detach() if b is not None else torch.zeros(w, dtype=linear.weight.dtype)
                    for b, w, linear in zip(biases, widths, linears, strict=True)
                ]
            )
        )
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._unread: set[int] = set()

    def output(self, x: torch.Tensor, member: int) -> torch.Tensor:
        if x is not self._input or member not in self._unread or self._output is None:
            self._input, self._output = x, self._multiply(x)
            self._unread = set(range(len(self.bounds)))
        output = self._output
        self._unread.discard(member)
        if not self._unread:  # every member has its slice: hold no tensors between steps
            self._input = self._output = None
        start, end = self.bounds[member]
        return output[..., start:end]

    def _multiply(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        values, row_scale = quantize_rows(rows)
        product = torch._int_mm(values, self.weight.t())
        out = (product * row_scale).mul_(self.scale).to(x.dtype)
        if self.bias is not None:
            out += self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


class Int8Linear(nn.Module):
    """A member of an ``Int8Projections``: a drop-in for the ``nn.Linear`` it replaced."""

    def __init__(self, shared: Int8Projections, member: int, in_features: int) -> None:
        super().__init__()
        self.shared = shared
        self.member = member
        self.in_features = in_features
        start, end = shared.bounds[member]
        self.out_features = end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.output(x, self.member)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def check_quantization(method: str, device: str) -> None:
    """Raise ``ModelLoadError`` for a method or device ``quantize_model`` cannot take
    (called before the model loads too, so that a wrong flag fails fast)."""
    if method not in QUANTIZATION_METHODS:
        raise ModelLoadError(
            f"unknown --quantization {method!r}: choose from {', '.join(QUANTIZATION_METHODS)}"
        )
    if device != "cpu":
        raise ModelLoadError(
            f"--quantization {method} runs on the CPU (its int8 GEMM); on {device} serve "
            "bfloat16 instead"
        )


def quantize_model(model: Any, method: str, device: str) -> int:
    """Replace the decoder's linears in place; returns how many were replaced."""
    check_quantization(method, device)
    head = model.get_output_embeddings()
    replaced = 0
    for parent in list(model.modules()):
        linears = {
            name: child
            for name, child in parent.named_children()
            if type(child) is nn.Linear and child is not head and name not in _ROUTERS
        }
        if any(linear.in_features > _MAX_IN_FEATURES for linear in linears.values()):
            raise ModelLoadError(
                f"--quantization {method}: a linear reads more than {_MAX_IN_FEATURES} "
                "features, past what its int32 sums hold"
            )
        for group in _groups(linears):
            shared = Int8Projections([linears[name] for name in group])
            for member, name in enumerate(group):
                setattr(parent, name, Int8Linear(shared, member, linears[name].in_features))
                replaced += 1
    if replaced == 0:
        raise ModelLoadError(f"--quantization {method}: the model has no linear layers to quantise")
    return replaced


def _groups(linears: dict[str, nn.Linear]) -> list[tuple[str, ...]]:
    """The fused groups present in full (same input width), then every other linear alone."""
    groups: list[tuple[str, ...]] = []
    for group in _FUSED_GROUPS:
        members = [linears[name] for name in group if name in linears]
        if len(members) == len(group) and len({m.in_features for m in members}) == 1:
            groups.append(group)
    grouped = {name for group in groups for name in group}
    return groups + [(name,) for name in linears if name not in grouped]


def quantization_of(model: Any) -> str | None:
    """The method ``quantize_model`` applied to ``model``, or None."""
    quantized = any(isinstance(module, Int8Linear) for module in model.modules())
    return QUANTIZATION_METHODS[0] if quantized else None

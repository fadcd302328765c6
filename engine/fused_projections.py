"""Quantised linears as drop-ins for transformers' ``nn.Linear``s, one GEMM per input.

The projections a decoder layer applies to one tensor (q/k/v, gate/up) share one
multiply over their concatenated weights: one cast or quantisation of the input, one
larger GEMM instead of three (a CPU step at one row is dominated by per-call cost).
A quantisation method says how its weights multiply (``SharedProjections._product``)
and which linears it takes; the fusing, the slicing and the walk over the model are
here, once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

# Sibling projections that transformers' decoder layers apply to the same tensor.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# Linears that pick experts: every method leaves them in full precision (expert
# choice is discrete, a small error flips it), as SGLang does.
ROUTERS = frozenset({"gate", "router"})


class SharedProjections(ABC):
    """One multiply for the concatenated weights of projections that read one input.

    The first member called with an input computes every member's output; the others,
    called with that same tensor (transformers passes one object to q, k and v), take
    theirs without multiplying again. Called with another tensor, a member recomputes:
    slower, never wrong."""

    method = ""  # the ``--quantization`` name this form serves

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
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
        out = self._product(rows).to(x.dtype)
        if self.bias is not None:
            out += self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """Every member's output side by side for ``rows`` [M, K], in the GEMM's own
        dtype (float32 or ``rows``'): what ``engine/direct_decode.py`` slices itself."""
        out = self._product(rows)
        return out if self.bias is None else out + self.bias

    @abstractmethod
    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` [M, K] times the concatenated weights, transposed: [M, N]: each
        method's own GEMM."""


class ProjectionMember(nn.Module):
    """A member of a ``SharedProjections``: a drop-in for the ``nn.Linear`` it replaced."""

    def __init__(self, shared: SharedProjections, member: int, in_features: int) -> None:
        super().__init__()
        self.shared = shared
        self.member = member
        self.in_features = in_features
        start, end = shared.bounds[member]
        self.out_features = end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.output(x, self.member)

    def unrounded(self, x: torch.Tensor) -> torch.Tensor:
        """This member's output in its GEMM's own dtype (float32 from Sluice's packed
        kernels), not rounded to ``x``'s: what the LM head gives the sampler, which
        takes logits in any dtype (rounding would be one more copy, and less exact)."""
        start, end = self.shared.bounds[self.member]
        out = self.shared.product(x.reshape(-1, x.shape[-1]))
        if (start, end) != (0, out.shape[-1]):
            out = out[:, start:end]
        return out.reshape(*x.shape[:-1], end - start)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.shared.method}"
        )


def fused_groups(linears: dict[str, nn.Linear]) -> list[tuple[str, ...]]:
    """The fused groups present in full (same input width), then every other linear alone."""
    groups: list[tuple[str, ...]] = []
    for group in FUSED_GROUPS:
        members = [linears[name] for name in group if name in linears]
        if len(members) == len(group) and len({m.in_features for m in members}) == 1:
            groups.append(group)
    grouped = {name for group in groups for name in group}
    return groups + [(name,) for name in linears if name not in grouped]


def replace_linears(
    model: Any,
    takes: Callable[[str, nn.Linear], bool],
    build: Callable[[list[tuple[str, nn.Linear]]], SharedProjections],
) -> int:
    """Replace each ``nn.Linear`` that ``takes(qualified name, linear)`` accepts, fused
    with its siblings where they are all taken; returns how many were replaced."""
    replaced = 0
    for prefix, parent in list(model.named_modules()):
        linears = {
            name: child
            for name, child in parent.named_children()
            if type(child) is nn.Linear and takes(_qualified(prefix, name), child)
        }
        for group in fused_groups(linears):
            shared = build([(_qualified(prefix, name), linears[name]) for name in group])
            for member, name in enumerate(group):
                setattr(parent, name, ProjectionMember(shared, member, linears[name].in_features))
                replaced += 1
    return replaced


def quantization_of(model: Any) -> str | None:
    """The method whose projections ``model`` holds, or None."""
    for module in model.modules():
        if isinstance(module, ProjectionMember):
            return module.shared.method
    return None


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name

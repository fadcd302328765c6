"""Dense bfloat16 weights kept in oneDNN's blocked layout: reordered once at load.

torch's bfloat16 ``linear`` on the CPU is oneDNN's, which reorders a plain weight into
its blocked layout on every call: one more pass over the weight for each product. A
weight reordered once (``mkldnn::_reorder_linear_weight``, what inductor's freezing
does to the weights of a graph it compiles) is multiplied as it lies
(``mkldnn::_linear_pointwise``). On an Intel Xeon with AMX (2 threads, emptied caches)
Gemma 3's 262144×640 head took 26 ms at 64 rows against linear's 39, 14 against 23 at
16, and a 4096×640 projection 0.23 against 0.34 ms at 64 rows, with the same bits as
linear's at 1, 4, 16, 64 and 512 rows (docs/benchmarks.md).

The reordered tensor is opaque (``is_mkldnn``): nothing but oneDNN reads it, and
``torch.compile`` cannot trace it, so a server that compiles its step keeps the plain
weights."""

from __future__ import annotations

import torch

# The rows oneDNN chooses the blocked layout for: a decode batch's size. The layout
# serves any count (a 512-row prompt chunk as fast as linear's).
LAYOUT_ROWS = 64


def prepacks(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies ``dtype`` from a reordered weight here (bfloat16, where
    torch's oneDNN build takes it on this CPU)."""
    return (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's blocked layout (a new tensor)."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), LAYOUT_ROWS)
    return packed


def linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows`` [M, in] times ``weight``ᵀ, plain or reordered by ``prepack``, in the
    weight's dtype."""
    rows = rows.to(weight.dtype)
    if not weight.is_mkldnn:
        return torch.nn.functional.linear(rows, weight)
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
        rows.contiguous(), weight, None, "none", [], ""
    )
    return out

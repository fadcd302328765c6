"""The direct decode step's GEMMs (``decode_stack.cpp``'s ``Gemm``, built by
``direct_decode._gemm``) against the projections they describe: the same kernels on
the same weights, so the same numbers exactly, at one row, a few, and past the packed
kernel's rows (its dense weight, plain or in oneDNN's layout), biases added."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from sluice.engine.direct_decode import _gemm
from sluice.engine.fused_projections import ProjectionMember, SharedProjections
from sluice.engine.gguf_blocks import decode_rows
from sluice.engine.gguf_packed import Int4Projections
from sluice.engine.int8_projections import Int8Projections
from sluice.engine.plane_kernels import OwnPlanes, TorchPlanes
from sluice.engine.prepacked_dense import prepacks
from tests.unit.test_gguf_blocks import own_kernel, random_tensor

IN = 128
OUTS = (48, 16)  # two members, fused as one GEMM


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    own_kernel()


def _linears(seed: int) -> list[torch.nn.Linear]:
    torch.manual_seed(seed)
    return [torch.nn.Linear(IN, out, bias=True).to(torch.bfloat16) for out in OUTS]


def _members(shared: SharedProjections) -> torch.nn.Module:
    parent = torch.nn.Module()
    for i, name in enumerate(("a", "b")):
        setattr(parent, name, ProjectionMember(shared, i, IN))
    return parent


def _packed(file_type: str, kernel: Callable[..., Any]) -> SharedProjections:
    weights = [
        decode_rows(random_tensor(file_type, out, IN, seed), file_type, IN)
        for seed, out in enumerate(OUTS)
    ]
    shared = Int4Projections(_linears(1), weights, kernel=kernel)
    shared.max_rows = 4
    return shared


def _prepacked(shared: SharedProjections) -> SharedProjections:
    """``shared`` with its dense weight in oneDNN's layout, where oneDNN takes bf16."""
    assert isinstance(shared, Int4Projections)
    if prepacks(torch.bfloat16):
        shared.prepack_dense()
    return shared


CASES = {
    "own Q4_1": lambda: _packed("Q4_1", OwnPlanes),
    "own Q4_1, dense for oneDNN": lambda: _prepacked(_packed("Q4_1", OwnPlanes)),
    "own Q8_0": lambda: _packed("Q8_0", OwnPlanes),
    "own Q5_0": lambda: _packed("Q5_0", OwnPlanes),  # five-bit codes, where in blocks
    "torch Q4_1": lambda: _packed("Q4_1", TorchPlanes),
    "torch Q5_0": lambda: _packed("Q5_0", TorchPlanes),  # two planes, summed in float32
    "int8 rows": lambda: Int8Projections(_linears(2)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", [1, 3, 6])
@torch.inference_mode()
def test_a_shared_projection_multiplies_as_its_own_product(case: str, rows: int) -> None:
    shared = CASES[case]()
    gemm = _gemm(_members(shared), ("a", "b"))
    x = torch.randn(rows, IN).to(torch.bfloat16)
    assert torch.equal(gemm.multiply(x), shared.product(x))


@pytest.mark.parametrize("rows", [1, 5])
@torch.inference_mode()
def test_unfused_linears_multiply_as_one_joined_linear(rows: int) -> None:
    parent = torch.nn.Module()
    parent.a, parent.b = _linears(3)
    parent.b.bias = None  # a member without a bias adds zeros
    gemm = _gemm(parent, ("a", "b"))
    x = torch.randn(rows, IN).to(torch.bfloat16)
    expected = torch.cat([parent.a(x), parent.b(x)], dim=-1)
    torch.testing.assert_close(gemm.multiply(x), expected, rtol=1e-2, atol=1e-2)

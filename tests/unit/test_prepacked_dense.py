"""De-quantised bfloat16 weights reordered once for oneDNN (``prepacked_dense``): the
product is linear's, at one row, a few, a decode batch and a prompt chunk; a model's
packed projections are reordered where oneDNN multiplies their dtype and the step is
not compiled, and the layout kept is said."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.engine.gguf_packed import PREPACKED, prepack_dense
from sluice.engine.plane_kernels import OwnPlanes
from sluice.engine.prepacked_dense import linear, prepack, prepacks
from tests.unit.test_decode_stack_gemm import IN, _members, _packed

# Both products sum in float32 and round once to bfloat16; a layout that sums in
# another order may land one bfloat16 step (2⁻⁸ relative) away.
RTOL, ATOL = 2**-7, 2**-6


@pytest.mark.parametrize("rows", [1, 3, 64, 200])
@torch.inference_mode()
def test_a_prepacked_weight_multiplies_as_linear(rows: int) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(96, 160).to(torch.bfloat16)
    x = torch.randn(rows, 160)  # float32: linear casts it to the weight's dtype
    expected = F.linear(x.to(torch.bfloat16), weight)
    packed = prepack(weight) if prepacks(torch.bfloat16) else weight
    assert packed.is_mkldnn == prepacks(torch.bfloat16)
    got = linear(x, packed)
    assert (got.dtype, got.shape) == (torch.bfloat16, expected.shape)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


@torch.inference_mode()
def test_a_models_dense_weights_are_prepacked_unless_its_step_is_compiled() -> None:
    shared = _packed("Q4_1", OwnPlanes)  # bfloat16 linears
    model = _members(shared)
    plain = shared.dense.clone()
    assert prepack_dense(model, allowed=False) == "plain: --enable-torch-compile traces the weights"
    assert not shared.dense.is_mkldnn
    said = prepack_dense(model, allowed=True)
    if prepacks(torch.bfloat16):
        assert said == PREPACKED
    else:
        assert said == "plain: oneDNN here does not multiply bfloat16"
    assert shared.dense.is_mkldnn == prepacks(torch.bfloat16)
    assert shared.shape == (*plain.shape, 1)
    x = torch.randn(shared.max_rows + 2, IN).to(torch.bfloat16)  # past the packed rows
    torch.testing.assert_close(
        shared.product(x), F.linear(x, plain) + shared.bias, rtol=RTOL, atol=ATOL
    )


def test_float32_weights_stay_plain() -> None:
    shared = _packed("Q4_1", OwnPlanes)
    shared.dense = shared.dense.float()
    assert prepack_dense(_members(shared), allowed=True) == (
        "plain: oneDNN here does not multiply float32"
    )
    assert not shared.dense.is_mkldnn
    assert prepack_dense(torch.nn.Linear(4, 4), allowed=True) == "none de-quantised"

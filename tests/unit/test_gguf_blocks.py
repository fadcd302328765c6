"""The GGUF blocks decode to planes of 4-bit codes, scales and zeros whose ``(code − 8)
× scale + zero``, summed, is exactly what ``gguf``'s own de-quantisation makes of the
same bytes, for every type read exactly (random blocks: every code, high bit, signed
byte, scale bit pattern and 6-bit group scale is exercised); Q6_K's planes are within
one 8-bit step of it, exact where a group's larger scale applies; torch's packed
kernel multiplies by the planes' weights to the rounding of its bfloat16 scales and
zeros and of its bfloat16 arithmetic; Sluice's own holds Q4_0, Q4_1 and Q8_0 weights
exactly, the others to fp16's rounding, and multiplies them by int8-quantised activations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

from sluice.engine.gguf_blocks import (
    PACKABLE_TYPES,
    REQUANTISED_TYPES,
    Plane,
    decode_rows,
    q6_k_values,
)
from sluice.engine.gguf_packed import PACKED_MAX_ROWS, Int4Projections
from sluice.engine.native_kernels import planes_kernel
from sluice.engine.plane_kernels import OwnPlanes, TorchPlanes
from tests.conftest import missing

# Bytes per block and weights per block of each type (ggml's block layouts).
BLOCKS = {
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q4_K": (144, 256),
    "Q5_0": (22, 32),
    "Q8_0": (34, 32),
    "Q6_K": (210, 256),
}
# Where each block type keeps its fp16 factors (d; d and m; d and dmin).
HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_0": (0,), "Q8_0": (0,),
          "Q6_K": (208,)}  # fmt: skip
PLANES = {"Q4_0": 1, "Q4_1": 1, "Q4_K": 1, "Q5_0": 2, "Q8_0": 2, "Q6_K": 2}
EXACT_TYPES = [t for t in PACKABLE_TYPES if t not in REQUANTISED_TYPES]


def random_tensor(file_type: str, rows: int, in_features: int, seed: int) -> np.ndarray:
    """``rows`` rows of random blocks ([rows, bytes per row]) with finite fp16 factors
    of a weight's size (random bits would give infinities and NaNs)."""
    size, per_block = BLOCKS[file_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * in_features // per_block, size), dtype=np.uint8)
    for offset in HALVES[file_type]:
        half = rng.uniform(-0.05, 0.05, blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = half.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("file_type", EXACT_TYPES)
def test_blocks_decode_to_ggufs_own_values(file_type: str) -> None:
    raw = random_tensor(file_type, rows=24, in_features=512, seed=len(file_type))
    weight = decode_rows(raw, file_type, 512)
    expected = dequantize(raw, GGMLQuantizationType[file_type])
    assert expected.shape == weight.shape == (24, 512)
    assert len(weight.planes) == PLANES[file_type]
    for plane in weight.planes:
        assert plane.codes.max() <= 15 and plane.scale.shape == (24, 512 // 32)
    # (q − 8)·d + (m + 8d) against d·q + m: equal up to float32's own rounding
    np.testing.assert_allclose(weight.dequantize(), expected, rtol=0, atol=1e-6)
    assert not weight.requantised and weight.squared_error == 0


def test_q6_k_is_read_as_gguf_reads_it_and_re_quantised_within_a_step() -> None:
    """Q6_K's weights decode bit for bit as ``gguf`` de-quantises them; each group of
    32 re-quantised to 8-bit codes of step ``a / 4`` (``a`` its larger scale) keeps the
    ``a`` half exact and puts the other within half a step (one where a code clips at
    127); the distance it reports is the one there is."""
    raw = random_tensor("Q6_K", rows=24, in_features=512, seed=6)
    expected = dequantize(raw, GGMLQuantizationType.Q6_K)
    values, scales = q6_k_values(raw.reshape(-1, 210))
    np.testing.assert_array_equal(values.reshape(24, 512), expected)
    weight = decode_rows(raw, "Q6_K", 512)
    assert weight.requantised and len(weight.planes) == 2
    held = weight.dequantize()
    error = np.abs(held - expected)
    step = np.repeat(np.abs(weight.planes[1].scale), 32, axis=1)
    assert np.all(error <= weight.requantisation_bound())
    clipped = np.abs(expected) > 127.5 * step  # only an opposite-signed smaller half
    assert np.all(error[~clipped] <= step[~clipped] * (0.5 + 1e-5))
    halves = np.abs(scales.reshape(24, 32, 1)).repeat(16, axis=2).reshape(24, 512)
    larger = np.repeat(np.abs(scales).reshape(24, 16, 2).max(axis=2), 32, axis=1)
    exact = halves == larger  # the half whose scale sets the group's step
    np.testing.assert_allclose(held[exact], expected[exact], rtol=1e-6, atol=0)
    assert error[~exact].max() > 0  # the other half does move: the bound is what holds
    reported = (weight.squared_error / weight.squared_norm) ** 0.5
    actual = np.linalg.norm(held - expected) / np.linalg.norm(expected)
    assert reported == pytest.approx(actual, rel=1e-6)


def own_kernel() -> None:
    reason = planes_kernel()
    if reason is not None:
        missing(f"Sluice's packed kernel is not built here: {reason}", "builds it")


@pytest.mark.parametrize("file_type", PACKABLE_TYPES)
def test_torchs_kernel_holds_the_files_weights(file_type: str) -> None:
    """torch's kernel holds the file's scales and zeros rounded to bfloat16 (within
    ``error_bound`` of its weights), and the weights it multiplies by, read back by
    multiplying the identity, are those to bfloat16 arithmetic's rounding of
    ``(q − 8) × scale`` and ``+ zero`` (one rounding or two, as a CPU's kernel does it)
    and, for two planes, of their sum."""
    raw = random_tensor(file_type, rows=64, in_features=256, seed=7)
    weight = decode_rows(raw, file_type, 256)
    projections = Int4Projections(
        [torch.nn.Linear(256, 64, bias=False)], [weight], kernel=TorchPlanes
    )
    kernel, planes = projections.kernel, list(weight.planes)
    assert isinstance(kernel, TorchPlanes)
    eye = torch.eye(256)  # read back in forwards the packed kernel multiplies
    rows = PACKED_MAX_ROWS
    held = torch.cat([projections.output(eye[i : i + rows], 0) for i in range(0, 256, rows)])
    held = held.T.numpy()  # [out, in]
    rounded = kernel.held_weight(planes)  # the file's weights, bfloat16 scales and zeros
    arithmetic = np.zeros_like(held)
    for plane, (_, scales_zeros) in zip(weight.planes, kernel.planes, strict=True):
        scale, zero = (np.repeat(t.T.float().numpy(), 32, axis=1) for t in scales_zeros.unbind(-1))
        shifted = (plane.codes.astype(np.float32) - 8) * scale
        # ≤ 2⁻⁸ of the product, then ≤ 2⁻⁸ of the sum, which is at most the two summed
        arithmetic += (2 * np.abs(shifted) + np.abs(zero)) * 2.0**-8
    if len(weight.planes) > 1:  # the planes' sum rounds to bfloat16 as well
        arithmetic += np.abs(rounded) * 2.0**-8
    exact = weight.dequantize()
    assert np.all(np.abs(rounded - exact) <= kernel.error_bound(planes))
    assert np.abs(rounded - exact).max() > 0  # not exact: the bound is what holds
    assert np.all(np.abs(held - rounded) <= arithmetic)


def planes_weight(planes: list[Plane]) -> np.ndarray:
    """The planes' weights, unrounded (float64)."""
    weight: np.ndarray = sum(
        (p.codes - 8.0) * np.repeat(p.scale.astype(np.float64), 32, axis=1)
        + np.repeat(p.zero.astype(np.float64), 32, axis=1)
        for p in planes
    )
    return weight


# Whose blocks are held centred (every group's offset a whole number of scales).
CENTRED_TYPES = ("Q4_0", "Q5_0", "Q8_0", "Q6_K")


@pytest.mark.parametrize("file_type", PACKABLE_TYPES)
@pytest.mark.parametrize("out", [64, 76])
def test_own_kernel_holds_the_files_weights(file_type: str, out: int) -> None:
    """Sluice's kernel holds fp16 scales and offsets: the file's weights exactly for
    Q4_0, Q4_1 and Q8_0 (each scale and offset is the file's fp16 ``d`` or ``m`` times
    a power of two) and for Q5_0 held centred (no offset: ``(code − 144) × d``), the
    others' planes to fp16's rounding (``error_bound``): Q4_K's scale ``d × sc``, Q5_0's
    offset ``−144 d`` in rows (76 outputs are not whole blocks), Q6_K's re-quantised
    scales. Blocks are centred for the types whose offsets allow it."""
    own_kernel()
    raw = random_tensor(file_type, rows=out, in_features=256, seed=7)
    planes = list(decode_rows(raw, file_type, 256).planes)
    kernel = OwnPlanes(planes)
    assert kernel.centred == (kernel.blocked and file_type in CENTRED_TYPES)
    assert (kernel.offset is None) == kernel.centred
    assert kernel.five_bit == (kernel.centred and file_type == "Q5_0")
    held = kernel.held_weight(planes)
    exact = planes_weight(planes)
    if file_type in ("Q4_0", "Q4_1", "Q8_0") or (file_type == "Q5_0" and kernel.centred):
        assert np.array_equal(held, exact)
    else:
        assert np.all(np.abs(held - exact) <= kernel.error_bound(planes))
        assert np.abs(held - exact).max() > 0  # not exact: the bound is what holds


def test_joined_q5_0_and_q8_0_rows_are_centred_as_one() -> None:
    """Projections fused from Q5_0 rows (offset 144 scales) and Q8_0 rows (128), as
    Gemma 3's q/k/v, are held centred as one where the build holds blocks: the Q5_0
    codes moved by 16, the weights still the file's exactly, and the product the kernel
    keeping offsets gives, to what their held weights differ by (its rounded offsets)
    and float32's rounding. Without blocks both keep their offsets and multiply alike."""
    own_kernel()
    weights = [decode_rows(random_tensor(t, rows=32, in_features=256, seed=9), t, 256)
               for t in ("Q5_0", "Q8_0")]  # fmt: skip
    linears = [torch.nn.Linear(256, 32, bias=False) for _ in weights]
    joined = Int4Projections(linears, weights, kernel=None).planes
    assert joined is not None
    centred, kept = OwnPlanes(joined), OwnPlanes(joined, centred=False)
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(3)).double()
    assert not kept.centred and kept.offset is not None
    assert centred.centred == centred.blocked
    if not centred.blocked:
        assert torch.equal(centred.product(x.float()), kept.product(x.float()))
        return
    exact = planes_weight(joined)
    assert np.array_equal(centred.held_weight(joined), exact)
    rounded = kept.held_weight(joined) - exact
    assert np.abs(rounded).max() > 0  # fp16(−144 d) rounds
    magnitude = x.abs() @ torch.from_numpy(np.abs(exact)).T
    held_apart = x.abs() @ torch.from_numpy(np.abs(rounded)).T
    difference = (centred.product(x.float()) - kept.product(x.float())).double().abs()
    assert torch.all(difference <= held_apart + magnitude * 1e-5)


@pytest.mark.parametrize("file_type", PACKABLE_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 16, 17, 33, 48])
@pytest.mark.parametrize("out", [76, 80, 88])
@pytest.mark.parametrize("centred", [True, False], ids=["centred", "offsets"])
def test_own_kernel_multiplies_int8_activations(
    file_type: str, rows: int, out: int, centred: bool
) -> None:
    """``planes_mm`` is the product of its held weight and the activations quantised
    as llama.cpp's Q8_0 (per 32: scale ``max|a| / 127``, codes rounded to nearest
    even), to float32 accumulation's rounding, for every tail of the row tilings. One
    plane (8-bit codes or 4-bit ones) is held in blocks of the build's rows where the
    outputs are whole blocks: 80 are five of sixteen (AVX-512 VNNI) or ten of eight
    (AVX2), 88 eleven of eight (one row takes four blocks at a time, then the rest one
    at a time; three rows or more take two blocks at a time with AVX-512, one with
    AVX2, four rows a pass and then the rows left, and a last odd block eight rows a
    pass; from 16 rows, AMX's tiles take them where the CPU grants AMX, sixteen rows a
    tile, the last tile padded), centred where the type allows or keeping their
    offsets; 76 are never whole blocks."""
    own_kernel()
    raw = random_tensor(file_type, rows=out, in_features=512, seed=rows)
    planes = list(decode_rows(raw, file_type, 512).planes)
    kernel = OwnPlanes(planes, centred=centred)
    assert kernel.centred == (centred and kernel.blocked and file_type in CENTRED_TYPES)
    block = int(torch.ops.sluice_kernels.block_rows())
    one_plane = kernel.bytes or len(planes) == 1
    assert kernel.blocked == (block > 0 and one_plane and out % block == 0)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :32] = 0  # an all-zero group quantises to zeros, not NaNs
    groups = x.double().reshape(rows, -1, 32)
    scale = (groups.abs().amax(-1, keepdim=True).float() / 127).double()
    codes = torch.where(scale > 0, torch.round(groups / scale), torch.zeros_like(groups))
    quantised = (codes * scale).reshape(rows, 512)
    held = torch.from_numpy(kernel.held_weight(planes))
    expected = quantised @ held.T
    got = kernel.product(x)
    magnitude = quantised.abs() @ held.abs().T
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    got = got.double()
    assert torch.all((got - expected).abs() <= magnitude * 1e-5 + 1e-6)
    assert kernel.product(x.to(torch.bfloat16)).shape == (rows, out)  # any float input


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_five_bit_codes_at_their_extremes_multiply_exactly(rows: int) -> None:
    """Q5_0 blocks held as five-bit codes (0..31, centred at 16): weight rows of all-31
    and all-0 codes against activations of ±127 in every input are the largest sums of
    int16 pairs that AVX2 alone forms before widening (four steps of 2 × 31 × 127 =
    31 496 a lane); the product is still the held weight's, where summing a whole group
    in int16 would wrap."""
    own_kernel()
    out, k = 32, 256
    size, per_block = BLOCKS["Q5_0"]
    blocks = np.zeros((out, k // per_block, size), np.uint8)
    blocks[:, :, 0:2] = np.array([0.01], np.float16).view(np.uint8)  # d
    blocks[0::2, :, 2:] = 0xFF  # every high bit and low nibble set: codes 31
    planes = list(decode_rows(blocks.reshape(out, -1), "Q5_0", k).planes)
    kernel = OwnPlanes(planes)
    assert kernel.five_bit == kernel.blocked
    x = torch.ones(rows, k)
    x[1::2] = -1  # codes −127
    held = torch.from_numpy(kernel.held_weight(planes))
    expected = x.double() @ held.T
    assert torch.all((kernel.product(x).double() - expected).abs() <= expected.abs() * 1e-5 + 1e-6)


@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("out", [76, 80])
def test_own_kernel_reads_bfloat16_as_its_widening_on_any_threads(file_type: str, out: int) -> None:
    """A bfloat16 input is quantised as it is (not copied to float32 first), giving its
    float32 widening's products bit for bit; a prompt's 600 rows, quantised on two
    threads, give what one thread gives."""
    own_kernel()
    raw = random_tensor(file_type, rows=out, in_features=512, seed=out)
    kernel = OwnPlanes(list(decode_rows(raw, file_type, 512).planes))
    x = (torch.randn(600, 512, generator=torch.Generator().manual_seed(out)) * 3).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        got = kernel.product(x)
        widened = kernel.product(x.float())
        torch.set_num_threads(1)
        alone = kernel.product(x)
    finally:
        torch.set_num_threads(threads)
    assert got.dtype == torch.float32 and got.shape == (600, out)
    assert torch.equal(got, widened)
    assert torch.equal(got, alone)


def test_past_the_packed_rows_the_dense_weight_multiplies() -> None:
    """A forward of more rows than ``PACKED_MAX_ROWS`` (a prefill chunk) multiplies the
    de-quantised weight the linear was loaded with, exactly as that linear would."""
    raw = random_tensor("Q4_1", rows=48, in_features=64, seed=3)
    weight = decode_rows(raw, "Q4_1", 64)
    linear = torch.nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(weight.dequantize()))
    projections = Int4Projections([linear], [weight])
    x = torch.randn(PACKED_MAX_ROWS + 1, 64)
    with torch.no_grad():
        assert torch.equal(projections.output(x, 0), linear(x))
        packed = projections.output(x[:PACKED_MAX_ROWS].clone(), 0)
        assert not torch.equal(packed, linear(x[:PACKED_MAX_ROWS]))  # the packed kernel

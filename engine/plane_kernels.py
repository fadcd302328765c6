"""The two GEMMs a packed GGUF linear can run on its planes (``engine/gguf_blocks.py``:
4-bit codes, each group of 32 inputs meaning ``(code − 8) × scale + zero``).

- ``OwnPlanes``, where ``engine/native_kernels.py`` could build it: Sluice's
  ``planes_mm``, llama.cpp's way. Activations are quantised to int8 per group of 32
  (scale ``max|a| / 127``, as llama.cpp's Q8_0 activations), multiplied by the codes
  with integer dot products, both planes in one pass. It holds fp16 scales and one
  fp16 offset per group (``Σ zero − 8·scale`` over the planes): 5 bits a weight for a
  one-plane type, as the file's Q4_1 takes; two planes that are a byte's nibbles (Q5_0,
  Q8_0, Q6_K re-quantised) are held as one plane of 8-bit codes (9 bits a weight,
  against Q8_0's 8.5). One plane (8-bit codes, or a one-plane type's 4-bit
  ones) is held in blocks of sixteen rows side by side where the build has AVX-512
  VNNI, eight with AVX2 alone (``blocks_mm.cpp``: one vector of codes serves each
  activation row). Blocks whose
  every group's offset is a whole number ``c`` of scales (Q8_0, Q5_0 and Q6_K's
  re-quantised planes ``c`` = 128 or 144, Q4_0 8) are held centred, without an
  offset: their codes moved by ``C − c`` so that ``w = (code − C) × scale`` (``C`` =
  128, or 8 for 4-bit codes), which spares the kernel a multiply-add per group. 8-bit
  codes that, so moved, all fit 0..31 with ``C`` = 16 (Q5_0's) are held as five-bit:
  with AVX2 alone the kernel then sums their products in int16 and needs no sign step.
  That is the file's own weights exactly for
  Q4_0, Q4_1 and Q8_0 (each scale and offset the file's fp16 ``d`` or ``m`` times a
  power of two) and centred Q5_0, and to fp16's rounding for Q4_K (``d × sc``), Q5_0
  in rows (offset ``−144 d``) and Q6_K's re-quantised planes.
- ``TorchPlanes``: torch's ``_weight_int4pack_mm_for_cpu`` (group 32), once per plane,
  bfloat16 activations, scales and zeros.

Each says what it holds (``held_weight``) and how far that may be from the planes'
own weights (``error_bound``), which the unit tests check. Neither keeps the planes
it was built from: ``engine/kernel_choice.py`` builds both for a shape and times them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import numpy as np
import torch

from .gguf_blocks import GROUP, Plane
from .native_kernels import planes_kernel

# ``_convert_weight_to_int4pack_for_cpu``'s inner K tiles (its only supported value).
_INNER_K_TILES = 8


class PlaneKernel(Protocol):
    name: str

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` [M, K] times the weight, transposed: [M, N] (float32 or bfloat16)."""

    def held_weight(self, planes: list[Plane]) -> np.ndarray:
        """The weight [N, K] the kernel multiplies by (float64): ``planes``' codes (those
        it was built from) with the scales and zeros it holds."""

    def error_bound(self, planes: list[Plane]) -> np.ndarray:
        """How far ``held_weight`` may be from the planes' weights, each [N, K]."""


def _rounding(values: np.ndarray, significant_bits: int, smallest: float) -> np.ndarray:
    """At most half an ulp of each value in a float format with ``significant_bits``,
    or half its smallest step (subnormals)."""
    bound: np.ndarray = np.maximum(np.abs(values) * 2.0 ** (-significant_bits), smallest / 2)
    return bound


def _per_input(groups: np.ndarray) -> np.ndarray:
    repeated: np.ndarray = np.repeat(groups, GROUP, axis=1)
    return repeated


class _Form(NamedTuple):
    """How ``blocks_mm`` takes centred codes: ``w = (code − centre) × scale``, each code
    in 0..``top``."""

    centre: int
    top: int
    five_bit: bool = False


_FOUR_BIT = _Form(8, 15)
_EIGHT_BIT = _Form(128, 255)
_FIVE_BIT = _Form(16, 31, five_bit=True)


class OwnPlanes:
    """``torch.ops.sluice_kernels.planes_mm`` over up to two planes."""

    name = "sluice planes_mm (int8 activations per 32, integer dot products)"

    def __init__(self, planes: list[Plane], centred: bool = True) -> None:
        """``centred=False`` keeps blocks' offsets whatever they are (to compare)."""
        unavailable = planes_kernel()  # loads it (building it first where needed)
        if unavailable is not None:
            raise RuntimeError(f"Sluice's packed kernel is unavailable: {unavailable}")
        self.bytes = _split_byte(planes)
        if self.bytes:  # one plane of 8-bit codes: 16 × high + low, at the low scale
            codes = np.stack([16 * planes[0].codes + planes[1].codes]).astype(np.uint8)
            scales = np.stack([planes[1].scale])
        else:
            codes = np.stack([_pack_group_halves(p.codes) for p in planes])
            scales = np.stack([p.scale for p in planes])
        offset = _planes_offset(planes)
        self.codes = torch.from_numpy(np.ascontiguousarray(codes))
        self.scales = torch.from_numpy(scales).to(torch.float16).contiguous()
        self.offset: torch.Tensor | None = torch.from_numpy(offset).to(torch.float16).contiguous()
        block = int(torch.ops.sluice_kernels.block_rows())
        # One plane (8-bit codes, or 4-bit ones) in blocks of rows side by side, where
        # the build multiplies them so; centred where its groups allow.
        self.blocked = block > 0 and len(codes) == 1 and codes.shape[1] % block == 0
        self.centred = False
        self.form = _EIGHT_BIT if self.bytes else _FOUR_BIT
        if self.blocked:
            one = codes[0] if self.bytes else planes[0].codes
            centres = None
            forms = (_FIVE_BIT, _EIGHT_BIT) if self.bytes else (_FOUR_BIT,)
            for form in forms if centred else ():  # the narrowest that the codes fit
                centres = _centres(one, scales[0], offset, form)
                if centres is not None:
                    self.form = form
                    break
            self.centred = centres is not None
            if centres is not None and np.any(centres != self.form.centre):
                # Modulo 256: every moved code is in range (``_centres``), and uint8
                # arithmetic spares a wider copy of a head's codes.
                shift = ((self.form.centre - centres) % 256).astype(np.uint8)
                rows, groups = centres.shape
                one = (one.reshape(rows, groups, GROUP) + shift[:, :, None]).reshape(one.shape)
            self.codes = _blocks(block, one, self.bytes)
            self.scales = _side_by_side(block, scales[0])
            self.offset = None if self.centred else _side_by_side(block, offset)

    @property
    def five_bit(self) -> bool:
        """Blocks of 8-bit codes all in 0..31, centred at 16 (``planes_mm``'s five_bit)."""
        return self.centred and self.form.five_bit

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = torch.ops.sluice_kernels.planes_mm(
            rows, self.codes, self.scales, self.offset, self.five_bit
        )
        return result

    def row_major_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales [P, N, G] and offset [N, G], whichever the layout (centred: ``−C ×
        scale``, for the codes as held)."""
        if not self.blocked:
            assert self.offset is not None
            return self.scales, self.offset
        blocks, groups, block = self.scales.shape
        scales = self.scales.permute(0, 2, 1).reshape(1, blocks * block, groups)
        if self.offset is None:  # exact: C is a power of two
            return scales, (-self.form.centre * scales[0].float()).half()
        return scales, self.offset.permute(0, 2, 1).reshape(blocks * block, groups)

    def held_weight(self, planes: list[Plane]) -> np.ndarray:
        scales, offset = self.row_major_values()
        codes = (
            [16 * planes[0].codes.astype(np.int64) + planes[1].codes]
            if self.bytes
            else [p.codes.astype(np.int64) for p in planes]
        )
        if self.centred:  # (code − c) × scale: the codes as the planes have them
            centres = _centres(codes[0], planes[-1].scale, _planes_offset(planes), self.form)
            assert centres is not None
            scale = scales[0].double().numpy()
            weight: np.ndarray = (codes[0] - _per_input(centres)) * _per_input(scale)
            return weight
        weight = _per_input(offset.double().numpy())
        for plane_codes, scale in zip(codes, scales, strict=True):
            weight = weight + plane_codes * _per_input(scale.double().numpy())
        return weight

    def error_bound(self, planes: list[Plane]) -> np.ndarray:
        # fp16: 11 significant bits, smallest step 2⁻²⁴. A code is at most 15.
        offset = sum(p.zero.astype(np.float64) - 8 * p.scale for p in planes)
        bound = _rounding(np.asarray(offset), 11, 2.0**-24)
        for plane in planes[1:] if self.bytes else planes:  # 8-bit: the low scale, codes ≤ 255
            code = 255 if self.bytes else 15
            bound = bound + code * _rounding(plane.scale.astype(np.float64), 11, 2.0**-24)
        return _per_input(bound) * (1 + 1e-6)


class TorchPlanes:
    """``_weight_int4pack_mm_for_cpu`` once per plane, summed in float32."""

    name = "torch _weight_int4pack_mm_for_cpu (bfloat16 activations)"

    def __init__(self, planes: list[Plane]) -> None:
        self.planes: list[tuple[torch.Tensor, torch.Tensor]] = []
        for plane in planes:
            codes = torch.from_numpy(plane.codes).to(torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _INNER_K_TILES)
            # The kernel's layout: [in / 32, out, (scale, zero)].
            scales_zeros = torch.stack(
                [torch.from_numpy(plane.scale).T, torch.from_numpy(plane.zero).T], dim=-1
            ).to(torch.bfloat16)
            self.planes.append((packed, scales_zeros.contiguous()))

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.to(torch.bfloat16)
        parts: list[torch.Tensor] = [
            torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, GROUP, scales_zeros)
            for packed, scales_zeros in self.planes
        ]
        if len(parts) == 1:
            return parts[0]
        # Two planes: summed in float32, so that the sum adds no bfloat16 rounding of
        # its own (the high plane's part is the larger by up to 16×).
        total = parts[0].float()
        for part in parts[1:]:
            total += part
        return total

    def held_weight(self, planes: list[Plane]) -> np.ndarray:
        weight = np.zeros(planes[0].codes.shape)
        for plane, (_, scales_zeros) in zip(planes, self.planes, strict=True):
            scale, zero = (_per_input(t.T.double().numpy()) for t in scales_zeros.unbind(-1))
            weight = weight + (plane.codes.astype(np.float64) - 8) * scale + zero
        return weight

    def error_bound(self, planes: list[Plane]) -> np.ndarray:
        # bfloat16: 8 significant bits; ``code − 8`` is at most 8 in size.
        bound = sum(
            8 * _rounding(p.scale.astype(np.float64), 8, 0.0)
            + _rounding(p.zero.astype(np.float64), 8, 0.0)
            for p in planes
        )
        return _per_input(np.asarray(bound)) * (1 + 1e-6)


def _planes_offset(planes: list[Plane]) -> np.ndarray:
    """Each group's offset ``Σ zero − 8·scale`` over the planes, [N, G] (summed in
    float64, kept as float32)."""
    offset = sum(
        (p.zero.astype(np.float64) - 8 * p.scale.astype(np.float64) for p in planes),
        np.zeros(planes[0].scale.shape),
    )
    return np.asarray(offset, dtype=np.float32)


def _centres(
    codes: np.ndarray, scale: np.ndarray, offset: np.ndarray, form: _Form
) -> np.ndarray | None:
    """Each group's ``c`` [N, G] where ``offset = −c × scale`` exactly and the codes
    moved by ``form.centre − c`` stay in ``form``'s range; None where any group has no
    such ``c`` (Q4_1's and Q4_K's offsets are not whole numbers of scales)."""
    scale = scale.astype(np.float64)
    offset = offset.astype(np.float64)
    nonzero = scale != 0
    ratio = -offset[nonzero] / scale[nonzero]
    if not np.all(np.abs(ratio) <= 1024):  # no code could reach it (and no inf, NaN)
        return None
    centres = np.full(scale.shape, form.centre, np.int64)  # all-zero scales: any c
    centres[nonzero] = np.rint(ratio)
    if not np.array_equal(-centres * scale, offset):
        return None
    rows, groups = scale.shape
    per_group = codes.reshape(rows, groups, -1)
    shift = form.centre - centres
    if (per_group.min(-1) + shift).min() < 0 or (per_group.max(-1) + shift).max() > form.top:
        return None
    return centres


def _split_byte(planes: list[Plane]) -> bool:
    """Two planes that are one byte's high and low nibbles (Q5_0, Q8_0, Q6_K re-quantised:
    the high plane's scale exactly 16 × the low one's), which 8-bit codes hold at once."""
    return len(planes) == 2 and np.array_equal(planes[0].scale, 16 * planes[1].scale)


def _blocks(block: int, codes: np.ndarray, bytes_: bool) -> torch.Tensor:
    """Codes [N, K] (8-bit, or 4-bit in 0..15) in blocks of ``block`` rows side by side
    (``blocks_mm.cpp``): [N/block, K/4, block, 4] bytes, each four inputs' codes row after
    row; 4-bit ones [N/block, K/8, block, 4], input ``8j + i`` in byte ``i``'s low nibble
    and ``8j + 4 + i`` in its high one."""
    rows, in_features = codes.shape
    if bytes_:
        laid = codes.reshape(rows // block, block, in_features // 4, 4)
    else:
        eights = codes.reshape(rows // block, block, in_features // 8, 2, 4).astype(np.uint8)
        laid = eights[:, :, :, 0, :] | (eights[:, :, :, 1, :] << 4)
    return torch.from_numpy(np.ascontiguousarray(laid.transpose(0, 2, 1, 3)))


def _side_by_side(block: int, values: np.ndarray) -> torch.Tensor:
    """Per-group values [N, G] as [N/block, G, block] fp16: a group's rows side by side."""
    rows, groups = values.shape
    laid = np.asarray(values, dtype=np.float32).reshape(rows // block, block, groups)
    return torch.from_numpy(np.ascontiguousarray(laid.transpose(0, 2, 1))).to(torch.float16)


def _pack_group_halves(codes: np.ndarray) -> np.ndarray:
    """[N, K] codes in 0..15 → [N, K / 2] bytes: in each group of 32, byte ``j`` holds
    input ``j`` in its low nibble and input ``j + 16`` in its high one."""
    rows, in_features = codes.shape
    groups = codes.reshape(rows, in_features // GROUP, 2, GROUP // 2)
    packed = groups[:, :, 0, :] | (groups[:, :, 1, :] << 4)
    return np.ascontiguousarray(packed.reshape(rows, in_features // 2).astype(np.uint8))


KernelFactory = Callable[[list[Plane]], PlaneKernel]
KERNELS: dict[str, KernelFactory] = {"own": OwnPlanes, "torch": TorchPlanes}


def plane_kernel(planes: list[Plane]) -> PlaneKernel:
    """Sluice's own kernel where it is built for this machine, else torch's (where no
    measurement chooses: ``engine/kernel_choice.py`` does for a served model)."""
    if planes_kernel() is None:
        return OwnPlanes(planes)
    return TorchPlanes(planes)

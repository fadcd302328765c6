"""A GGUF file's weight blocks, read as they are stored: for each linear of the loaded
model whose tensor is Q4_0, Q4_1, Q4_K, Q5_0 or Q8_0, planes of 4-bit codes with one
scale and zero per group of 32 inputs, each meaning ``(code − 8) × scale + zero``, that
sum to the weight exactly (the form torch's packed int4 GEMM multiplies by;
``engine/gguf_packed.py``). Q6_K, whose scales are per 16 weights, has no such exact
form: it is re-quantised to 8 bits per group of 32 (two planes), and how far that moves
its weights is measured as it is done.

What each block means (ggml's ``ggml-quants.c``):

- Q4_0, 32 weights: fp16 ``d``, 16 bytes of codes; ``w = d × (q − 8)``: scale ``d``,
  zero 0.
- Q4_1, 32 weights: fp16 ``d`` and ``m``; ``w = d × q + m``: scale ``d``, zero
  ``m + 8d``.
- Q4_K, 256 weights in eight groups of 32: fp16 ``d`` and ``dmin``, twelve bytes of
  6-bit group scales ``sc`` and mins ``mn``, 128 bytes of codes; ``w = d·sc × q −
  dmin·mn``: scale ``d·sc``, zero ``8·d·sc − dmin·mn``.
- Q5_0, 32 weights: fp16 ``d``, 32 high bits ``h``, 16 bytes of low nibbles ``l``;
  ``w = d × (16h + l − 16)``: two planes, ``h + 8`` with scale ``16d``, and ``l`` with
  scale ``d``, zero ``−8d``.
- Q8_0, 32 weights: fp16 ``d``, 32 signed bytes ``q``; ``w = d × q`` with ``q =
  16·(q >> 4) + (q & 15)``: two planes, ``(q >> 4) + 8`` with scale ``16d``, and
  ``q & 15`` with scale ``d``, zero ``8d``. (Two 4-bit planes read 8 bits a weight: a
  Q5_0 weight costs more than its file's 5.5, still half of bfloat16's 16.)
- Q6_K, 256 weights in sixteen groups of 16: 128 bytes of low nibbles, 64 of high bit
  pairs, sixteen signed 8-bit scales ``sc``, fp16 ``d``; ``w = d·sc × (q − 32)``, ``q``
  in 0..63. A group of 32 spans two scales ``a`` and ``b``, which one scale per 32
  cannot express, so each group is re-quantised to 8-bit codes ``Q`` with step
  ``s = a / 4`` where ``|a| ≥ |b|``: the ``a`` half is exact (``Q = 4(q − 32)``), the
  ``b`` half rounds to the nearest step (at most ``s / 2`` off; ``s`` where ``Q`` clips
  at 127), then split as Q8_0 is. Two planes read 8 bits a weight against the file's
  6.6, a quarter of float32's.

Codes sit two to a byte: in Q4_0 / Q4_1 / Q5_0 a byte's low nibble is weight ``j`` and its
high nibble ``j + 16`` of the block; in Q4_K each 32 bytes hold a pair of groups, low
nibbles the first, high the second.

Names: transformers maps the file's tensors to the model's parameters
(``get_gguf_hf_weights_map``) and some architectures reorder rows on the way
(LLaMA's q and k projections are stored permuted for rotary). The row order is found by
passing row numbers through the same tensor processor, so the blocks line up with the
loaded weight whatever the architecture; the caller then checks them against it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

GROUP = 32  # inputs per scale and zero, in every type read here
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # one plane
WIDE_TYPES = ("Q5_0", "Q8_0")  # two planes
REQUANTISED_TYPES = ("Q6_K",)  # two planes of 8-bit codes, re-quantised per 32
PACKABLE_TYPES = FOUR_BIT_TYPES + WIDE_TYPES + REQUANTISED_TYPES


@dataclass(frozen=True)
class Plane:
    """4-bit codes with a scale and zero per 32 inputs: ``(code − 8) × scale + zero``."""

    codes: np.ndarray  # [out, in] uint8 in 0..15
    scale: np.ndarray  # [out, in / 32] float32
    zero: np.ndarray  # [out, in / 32] float32

    def dequantize(self) -> np.ndarray:
        scale = np.repeat(self.scale, GROUP, axis=1)
        zero = np.repeat(self.zero, GROUP, axis=1)
        weight: np.ndarray = (self.codes.astype(np.float32) - 8) * scale + zero
        return weight


@dataclass(frozen=True)
class BlockWeight:
    """One linear's weight as its file stores it: the sum of its planes (one for a
    4-bit type; two for Q5_0 and Q8_0, whose codes split into a high and a low part)."""

    planes: tuple[Plane, ...]
    file_type: str  # the GGUF type the blocks came from
    # A re-quantised type's distance from the file: Σ (planes' weight − file's)² and
    # Σ file's², over the whole weight (both 0 where the planes are the file's own).
    squared_error: float = 0.0
    squared_norm: float = 0.0

    @property
    def requantised(self) -> bool:
        return self.file_type in REQUANTISED_TYPES

    @property
    def shape(self) -> tuple[int, int]:
        rows, columns = self.planes[0].codes.shape
        return rows, columns

    def dequantize(self) -> np.ndarray:
        """The weight the planes mean, in float32 ([out, in]): the file's own, or for a
        re-quantised type within ``requantisation_bound`` of it."""
        weight = self.planes[0].dequantize()
        for plane in self.planes[1:]:
            weight += plane.dequantize()
        return weight

    def requantisation_bound(self) -> np.ndarray:
        """How far each weight the planes mean may be from the file's ([out, in]): one
        8-bit step (the low plane's scale) for a re-quantised type, else 0 (beyond
        float32's own rounding)."""
        if not self.requantised:
            return np.zeros(self.shape, np.float32)
        step = np.abs(self.planes[-1].scale) * (1 + 1e-5)
        return np.repeat(step, GROUP, axis=1)


@dataclass(frozen=True)
class GgufTensors:
    """Which GGUF type holds each of the model's weights, and the packable ones decoded."""

    types: dict[str, str]  # the model's parameter name → the file's type name
    packable: dict[str, BlockWeight]  # the model's parameter name → its blocks


# A decoder turns [n, bytes per block] into planes of (codes [n, weights per block],
# scale [n, groups per block], zero [n, groups per block]).
_Planes = list[tuple[np.ndarray, np.ndarray, np.ndarray]]


def _nibble_pairs(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes → [blocks, 32] codes: low nibbles first, then high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _half(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def decode_q4_0(blocks: np.ndarray) -> _Planes:
    """18 bytes a block: ``w = d × (q − 8)``."""
    d = _half(blocks[:, 0:2])
    return [(_nibble_pairs(blocks[:, 2:18]), d, np.zeros_like(d))]


def decode_q4_1(blocks: np.ndarray) -> _Planes:
    """20 bytes a block: ``w = d × q + m``."""
    d = _half(blocks[:, 0:2])
    m = _half(blocks[:, 2:4])
    return [(_nibble_pairs(blocks[:, 4:20]), d, m + 8 * d)]


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Twelve bytes of a Q4_K block → its eight 6-bit scales and eight 6-bit mins.
    Bytes 0–3 hold scales 0–3 in their low six bits (their top two bits are the high
    bits of scales 4–7), bytes 4–7 the mins likewise, and bytes 8–11 the low four bits
    of scale (low nibble) and min (high nibble) 4–7."""
    low_sc, low_mn, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([low_sc & 0x3F, (high & 0x0F) | ((low_sc >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([low_mn & 0x3F, (high >> 4) | ((low_mn >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def decode_q4_k(blocks: np.ndarray) -> _Planes:
    """144 bytes a block of 256: ``w = d·sc × q − dmin·mn`` per group of 32."""
    d = _half(blocks[:, 0:2])
    dmin = _half(blocks[:, 2:4])
    sc, mn = _k_scales(blocks[:, 4:16])
    qs = blocks[:, 16:144].reshape(-1, 4, 32)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
    scale = d * sc
    return [(codes, scale, 8 * scale - dmin * mn)]


def _split_planes(high: np.ndarray, low: np.ndarray, d: np.ndarray, offset: float) -> _Planes:
    """``w = d × (16·high + low − offset)`` as two planes: ``high`` (in −8..7) with scale
    ``16d``, and ``low`` (in 0..15) with scale ``d`` and zero ``(8 − offset)·d``."""
    return [
        ((high + 8).astype(np.uint8), 16 * d, np.zeros_like(d)),
        (low.astype(np.uint8), d, (8 - offset) * d),
    ]


def decode_q5_0(blocks: np.ndarray) -> _Planes:
    """22 bytes a block: fp16 ``d``, 32 high bits (bit ``j`` is weight ``j``'s), 16
    bytes of low nibbles; ``w = d × (q − 16)``."""
    d = _half(blocks[:, 0:2])
    high_bits = blocks[:, 2:6].copy().view("<u4")  # [n, 1]
    high = (high_bits >> np.arange(32, dtype=np.uint32)) & 1
    return _split_planes(high.astype(np.int16), _nibble_pairs(blocks[:, 6:22]), d, 16)


def decode_q8_0(blocks: np.ndarray) -> _Planes:
    """34 bytes a block: fp16 ``d``, 32 signed bytes; ``w = d × q``, ``q = 16·(q >> 4)
    + (q & 15)``."""
    d = _half(blocks[:, 0:2])
    q = blocks[:, 2:34].copy().view(np.int8).astype(np.int16)
    return _split_planes(q >> 4, q & 0x0F, d, 0)


def q6_k_values(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """210 bytes a block of 256 → its weights ``d·sc × (q − 32)`` in float32, computed
    in ggml's order ([n, 256]), and its sixteen scales ``d·sc`` ([n, 16]). Each half of
    128 weights has 64 bytes of ``ql`` and 32 of ``qh``: weights 0–31 are the low
    nibbles of ``ql[0:32]`` with bits 0–1 of ``qh``, 32–63 the low nibbles of
    ``ql[32:64]`` with bits 2–3, 64–95 and 96–127 the high nibbles with bits 4–5 and
    6–7."""
    ql = blocks[:, 0:128].reshape(-1, 2, 64)
    qh = blocks[:, 128:192].reshape(-1, 2, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)  # [n, 2, 128]
    high = np.concatenate([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)
    q = (low | (high << 4)).reshape(-1, 256).astype(np.float32) - 32
    scales = _half(blocks[:, 208:210]) * blocks[:, 192:208].copy().view(np.int8)
    values: np.ndarray = np.repeat(scales, 16, axis=1) * q
    return values, scales


def decode_q6_k(blocks: np.ndarray) -> _Planes:
    """Q6_K re-quantised: each group of 32 (two scales ``a``, ``b``, ``|a| ≥ |b|``) to
    8-bit codes of step ``a / 4``, split into two planes as Q8_0 is."""
    values, scales = q6_k_values(blocks)
    pairs = scales.reshape(-1, 2)
    larger = np.where(np.abs(pairs[:, 0]) >= np.abs(pairs[:, 1]), pairs[:, 0], pairs[:, 1])
    step = (larger / 4).reshape(-1, 8)  # [n, groups of 32]
    per_weight = np.repeat(np.where(step == 0, 1, step), GROUP, axis=1)  # 0: all weights 0
    codes = np.clip(np.rint(values / per_weight), -128, 127).astype(np.int16)
    return _split_planes(codes >> 4, codes & 0x0F, step, 0)


_DECODERS = {
    "Q4_0": (decode_q4_0, 32),
    "Q4_1": (decode_q4_1, 32),
    "Q4_K": (decode_q4_k, 256),
    "Q5_0": (decode_q5_0, 32),
    "Q8_0": (decode_q8_0, 32),
    "Q6_K": (decode_q6_k, 256),
}


def decode_rows(raw: np.ndarray, file_type: str, in_features: int) -> BlockWeight:
    """A tensor's bytes ([rows, bytes per row]) → its planes (for a re-quantised type,
    with their distance from the file's weights)."""
    decode, per_block = _DECODERS[file_type]
    rows = raw.shape[0]
    blocks = raw.reshape(rows * (in_features // per_block), -1)
    planes = tuple(
        Plane(
            codes=codes.reshape(rows, in_features),
            scale=scale.reshape(rows, in_features // GROUP),
            zero=zero.reshape(rows, in_features // GROUP),
        )
        for codes, scale, zero in decode(blocks)
    )
    weight = BlockWeight(planes, file_type)
    if not weight.requantised:
        return weight
    values = q6_k_values(blocks)[0].reshape(rows, in_features).astype(np.float64)
    error = float(np.sum((weight.dequantize() - values) ** 2))
    return replace(weight, squared_error=error, squared_norm=float(np.sum(values**2)))


def _tensor_processor(reader: Any, model: Any) -> Any:
    """The processor transformers applied to this file's tensors when it loaded them
    (chosen, as there, by the file's own architecture name)."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        read_field,
    )

    architecture = (read_field(reader, "general.architecture") or [""])[0]
    config = (getattr(model.config, "text_config", None) or model.config).to_dict()
    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)


def _row_order(processor: Any, gguf_name: str, rows: int) -> np.ndarray | None:
    """Where each of the model's rows sits in the file: row numbers passed through the
    processor that reorders the weight on load (None where it does something else
    than reorder rows, so the blocks cannot be carried over)."""
    index = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    try:
        out = np.asarray(processor.process(weights=index, name=gguf_name).weights)
    except (TypeError, KeyError, AttributeError, ValueError):
        return None
    if out.shape != (rows, 1) or not np.array_equal(np.sort(out[:, 0]), index[:, 0]):
        return None
    return out[:, 0].astype(np.int64)


def read_gguf_tensors(path: Path, model: Any) -> GgufTensors:
    """The types of ``model``'s weights in the GGUF file it was converted from, and the
    blocks of its packable weights in the model's own row order."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    reader = GGUFReader(path)
    processor = _tensor_processor(reader, model)
    names = get_gguf_hf_weights_map(model, processor)
    types: dict[str, str] = {}
    packable: dict[str, BlockWeight] = {}
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name)
        if hf_name is None:
            continue
        file_type = tensor.tensor_type.name
        types[hf_name] = file_type
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest first
        if file_type not in PACKABLE_TYPES or len(shape) != 2:
            continue
        rows, in_features = shape
        order = _row_order(processor, tensor.name, rows)
        if order is None:
            continue
        raw = np.asarray(tensor.data).reshape(rows, -1)[order]
        packable[hf_name] = decode_rows(raw, file_type, in_features)
    return GgufTensors(types, packable)

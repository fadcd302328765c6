"""A GGUF file's weight blocks, read as they are stored: for each linear of the loaded
model whose tensor is Q4_0, Q4_1, Q4_K, Q5_0 or Q8_0, planes of 4-bit codes with one
scale and zero per group of 32 inputs, each meaning ``(code − 8) × scale + zero``, that
sum to the weight exactly (the form torch's packed int4 GEMM multiplies by;
``engine/gguf_packed.py``).

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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GROUP = 32  # inputs per scale and zero, in every type read here
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # one plane
WIDE_TYPES = ("Q5_0", "Q8_0")  # two planes
PACKABLE_TYPES = FOUR_BIT_TYPES + WIDE_TYPES


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

    @property
    def shape(self) -> tuple[int, int]:
        rows, columns = self.planes[0].codes.shape
        return rows, columns

    def dequantize(self) -> np.ndarray:
        """The weight the blocks mean, in float32 ([out, in])."""
        weight = self.planes[0].dequantize()
        for plane in self.planes[1:]:
            weight += plane.dequantize()
        return weight


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


_DECODERS = {
    "Q4_0": (decode_q4_0, 32),
    "Q4_1": (decode_q4_1, 32),
    "Q4_K": (decode_q4_k, 256),
    "Q5_0": (decode_q5_0, 32),
    "Q8_0": (decode_q8_0, 32),
}


def decode_rows(raw: np.ndarray, file_type: str, in_features: int) -> BlockWeight:
    """A tensor's bytes ([rows, bytes per row]) → its planes."""
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
    return BlockWeight(planes, file_type)


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

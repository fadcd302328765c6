"""Serving a GGUF file's own 4-bit weights: ``--quantization gguf``, the default for a
quantised GGUF on the CPU.

Each decoder linear that the file stores as Q4_0, Q4_1 or Q4_K keeps its 4-bit codes
and is multiplied by torch's packed int4 GEMM (``_weight_int4pack_mm_for_cpu``, group
32), which reads a quarter of the bytes of a bfloat16 weight (an eighth of float32's).
The kernel's weight is ``(code − 8) × scale + zero`` per group of 32 inputs, which is
exactly what each of those blocks means (``engine/gguf_blocks.py``); its scales and
zeros are bfloat16, so a weight differs from the file's by at most the rounding of its
block's scale and zero (``weight_error_bound``; ``tests/engine/test_gguf_packed.py``
checks both). Its activations are bfloat16 too (the kernel's fast path): a linear's
input is rounded to bfloat16 whatever ``--dtype`` the rest of the model runs in.

Left as loaded (de-quantised, in ``--dtype``): every weight of another type (Q5_0,
Q6_K and Q8_0 have more than four bits a weight, so the int4 kernel cannot hold them
exactly; the tied Q8_0 embedding / LM head of both shipped models is one), and MoE
routers. What was packed and what was not is reported by type (``PackingReport``) in
the start-up log, ``/server_info`` and ``/v1/models``.

The blocks are decoded from the file once and kept beside the converted model
(``gguf_4bit.safetensors``), checked against the loaded weights when they are made,
so later starts read them in well under a second.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
from torch import nn

from .errors import ModelLoadError
from .fused_projections import ROUTERS, SharedProjections, replace_linears
from .gguf_blocks import GROUP, FourBitWeight, GgufTensors, read_gguf_tensors

log = structlog.get_logger(__name__)

METHOD = "gguf"
CACHE_FILE = "gguf_4bit.safetensors"
# ``_convert_weight_to_int4pack_for_cpu``'s inner K tiles (its only supported value).
_INNER_K_TILES = 8


@dataclass(frozen=True)
class PackingReport:
    """How many of the model's linear weights were packed, and of what file types."""

    packed: dict[str, int] = field(default_factory=dict)  # file type → linears packed
    dense: dict[str, int] = field(default_factory=dict)  # file type → linears left dense

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"packed": dict(self.packed), "dense": dict(self.dense)}


def weight_error_bound(weight: FourBitWeight) -> np.ndarray:
    """How far each weight the kernel holds may be from the file's: code − 8 is at most
    8 in size, times the bfloat16 rounding of its scale, plus its zero's ([out, in])."""
    rounding = 2.0**-8  # bfloat16 keeps 8 significant bits: half an ulp is ≤ 2⁻⁸ of it
    per_group = (8 * np.abs(weight.scale) + np.abs(weight.zero)) * rounding
    return np.repeat(per_group, GROUP, axis=1) * (1 + 1e-6)


class Int4Projections(SharedProjections):
    """Concatenated 4-bit weights in the packed int4 layout, bfloat16 scales and zeros."""

    method = METHOD

    def __init__(self, linears: list[nn.Linear], weights: list[FourBitWeight]) -> None:
        super().__init__(linears)
        codes = torch.from_numpy(np.concatenate([w.codes for w in weights])).to(torch.int32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _INNER_K_TILES)
        scale = torch.from_numpy(np.concatenate([w.scale for w in weights]))
        zero = torch.from_numpy(np.concatenate([w.zero for w in weights]))
        # The kernel's layout: [in / 32, out, (scale, zero)].
        self.scales_zeros = torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous()

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        product: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows.to(torch.bfloat16), self.packed, GROUP, self.scales_zeros
        )
        return product


def pack_model(model: Any, folder: Path, source: Path) -> PackingReport:
    """Replace the decoder's 4-bit linears in place with packed ones (none where the
    file's 4-bit tensors are not linears: the report says so)."""
    tensors = four_bit_tensors(model, folder, source)
    head = model.get_output_embeddings()

    def takes(name: str, linear: nn.Linear) -> bool:
        weight = tensors.four_bit.get(f"{name}.weight")
        return (
            linear is not head
            and name.rsplit(".", 1)[-1] not in ROUTERS
            and weight is not None
            and weight.codes.shape == tuple(linear.weight.shape)
        )

    def build(group: list[tuple[str, nn.Linear]]) -> SharedProjections:
        linears = [linear for _, linear in group]
        return Int4Projections(linears, [tensors.four_bit[f"{name}.weight"] for name, _ in group])

    # A file type per weight tensor, found by identity (a tied head is its embedding).
    file_types = {
        id(param): tensors.types[name]
        for name, param in model.named_parameters(remove_duplicate=False)
        if name in tensors.types
    }
    linears = [module for module in model.modules() if type(module) is nn.Linear]
    replace_linears(model, takes, build)
    still_dense = {id(module) for module in model.modules() if type(module) is nn.Linear}
    packed: Counter[str] = Counter()
    dense: Counter[str] = Counter()
    for linear in linears:
        file_type = file_types.get(id(linear.weight), "not in the file")
        (dense if id(linear) in still_dense else packed)[file_type] += 1
    return PackingReport(dict(sorted(packed.items())), dict(sorted(dense.items())))


def four_bit_tensors(model: Any, folder: Path, source: Path) -> GgufTensors:
    """The file's 4-bit blocks, from the cache beside the converted model where it is
    there, else decoded from ``source``, checked against ``model``'s weights and kept."""
    cached = folder / CACHE_FILE
    if cached.is_file():
        try:
            return _read_cache(cached)
        except (OSError, ValueError, KeyError) as exc:
            log.warning("re-reading the GGUF: its 4-bit cache is unreadable", error=str(exc))
    tensors = read_gguf_tensors(source, model)
    _check_against(model, tensors, source)
    try:
        _write_cache(cached, tensors)
    except OSError as exc:  # a read-only models folder decodes again next start
        log.warning("cannot keep the GGUF's 4-bit blocks", path=str(cached), error=str(exc))
    return tensors


def _check_against(model: Any, tensors: GgufTensors, source: Path) -> None:
    """Each decoded weight equals the one transformers de-quantised from the same file
    (it would not if a row order or a name were wrong)."""
    weights = dict(model.named_parameters())
    for name, weight in tensors.four_bit.items():
        loaded = weights.get(name)
        if loaded is None:
            continue
        expected = loaded.detach().float().numpy()
        if expected.shape != weight.codes.shape or not np.allclose(
            weight.dequantize(), expected, rtol=1e-6, atol=1e-6
        ):
            raise ModelLoadError(
                f"--quantization {METHOD}: {name} read from {source.name} does not match the "
                "de-quantised model; serve it with --quantization none"
            )


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    packed: np.ndarray = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)


def _write_cache(path: Path, tensors: GgufTensors) -> None:
    from safetensors.numpy import save_file

    arrays: dict[str, np.ndarray] = {}
    for name, weight in tensors.four_bit.items():
        arrays[f"{name}:codes"] = _pack_nibbles(weight.codes)
        arrays[f"{name}:scale"] = weight.scale
        arrays[f"{name}:zero"] = weight.zero
    file_types = {name: weight.file_type for name, weight in tensors.four_bit.items()}
    staging = path.with_name(f".{path.name}.partial")
    save_file(
        arrays,
        str(staging),
        metadata={"types": json.dumps(tensors.types), "four_bit": json.dumps(file_types)},
    )
    staging.replace(path)


def _read_cache(path: Path) -> GgufTensors:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata()
        file_types: dict[str, str] = json.loads(metadata["four_bit"])
        four_bit = {
            name: FourBitWeight(
                codes=_unpack_nibbles(f.get_tensor(f"{name}:codes")),
                scale=f.get_tensor(f"{name}:scale"),
                zero=f.get_tensor(f"{name}:zero"),
                file_type=file_type,
            )
            for name, file_type in file_types.items()
        }
    return GgufTensors(json.loads(metadata["types"]), four_bit)

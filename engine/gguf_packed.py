"""Serving a GGUF file's own quantised weights: ``--quantization gguf``, the default for
a quantised GGUF on the CPU.

Each linear that the file stores as Q4_0, Q4_1, Q4_K, Q5_0 or Q8_0 (the tied LM head
included) keeps the file's codes as planes of 4-bit codes (``engine/gguf_blocks.py``):
one for a 4-bit type, two for Q5_0 and Q8_0, whose codes split exactly into a high
and a low 4-bit plane. Q6_K, whose scales are per 16 weights, is re-quantised to 8 bits
per group of 32 (two planes): its distance from the file's weights is measured when
the blocks are decoded and reported (``PackingReport.requantised``). Each plane's
weight is ``(code − 8) × scale + zero`` per group of 32 inputs, which is exactly what
the exact types' blocks mean. Two GEMMs multiply the planes (``engine/plane_kernels.py``):
Sluice's own (int8 activations and integer dot products, as llama.cpp multiplies; fp16
scales, which hold Q4_0, Q4_1 and Q8_0 weights exactly) and torch's packed int4 GEMM
(bfloat16 activations, scales and zeros); a served model's shapes each run the one
measured faster on this machine (``engine/kernel_choice.py``). Each kernel's distance
from the planes' weights is bounded and tested (``tests/unit/test_gguf_blocks.py``).

Past ``max_rows`` rows (a prefill chunk, a large decode batch) a linear multiplies its
de-quantised weight instead, kept beside the packed one: the packed kernel reads fewer
bytes, which is what one to a few rows wait for, but multiplies group by group, which
many rows pay for where the dense kernel is faster per multiply-add. Where that turns
depends on the CPU and dtype (on an Intel Xeon whose AMX multiplies bf16, past 32–64
rows in bf16 and 512–1024 in fp32; with AVX-512 VNNI alone the blocks stayed ahead of
bf16 to 1024 rows, a prompt chunk and more), so the server measures it once per
machine and model (``engine/packed_rows.py``); unmeasured, it is ``PACKED_MAX_ROWS``.

Left as loaded (de-quantised, in ``--dtype``): any other type, and MoE routers. What
was packed and what was not is reported by file type (``PackingReport``) in the
start-up log and ``/server_info``.

The blocks are decoded from the file once and kept beside the converted model
(``CACHE_FILE``), checked against the loaded weights when they are made (a re-quantised
weight within its 8-bit step), so later starts read them in well under a second."""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
from torch import nn

from . import prepacked_dense
from .errors import ModelLoadError
from .fused_projections import ROUTERS, ProjectionMember, SharedProjections, replace_linears
from .gguf_blocks import GROUP, BlockWeight, GgufTensors, Plane, read_gguf_tensors
from .plane_kernels import PlaneKernel, plane_kernel

log = structlog.get_logger(__name__)

METHOD = "gguf"
# The decoded blocks beside the converted model: a new name whenever what is decoded
# changes, so that an older cache is not read as this one; the older names are removed
# when this one is written.
CACHE_FILE = "gguf_planes_v2.safetensors"
_OLD_CACHE_FILES = ("gguf_4bit.safetensors", "gguf_planes.safetensors")
# The most rows a forward multiplies packed, until measured on this machine. On SmolLM2
# (AMD Zen 4, bfloat16 around, docs/benchmarks.md) the packed step is ×2.3 / 1.75 / 1.23
# faster than the de-quantised one at 1 / 4 / 16 rows, ×0.72 at 64 and ×0.59 in a
# 512-token prefill.
PACKED_MAX_ROWS = 32


@dataclass(frozen=True)
class PackingReport:
    """How many of the model's linear weights were packed, and of what file types."""

    packed: dict[str, int] = field(default_factory=dict)  # file type → linears packed
    dense: dict[str, int] = field(default_factory=dict)  # file type → linears left dense
    # A re-quantised file type → ‖planes' weights − file's‖ ÷ ‖file's‖ over its linears.
    requantised: dict[str, float] = field(default_factory=dict)


def requantisation_error(weights: list[BlockWeight]) -> dict[str, float]:
    """Each re-quantised file type's relative RMS distance from the file's weights."""
    sums: dict[str, list[float]] = {}
    for weight in weights:
        if weight.requantised:
            error, norm = sums.setdefault(weight.file_type, [0.0, 0.0])
            sums[weight.file_type] = [error + weight.squared_error, norm + weight.squared_norm]
    return {t: (error / norm) ** 0.5 if norm else 0.0 for t, (error, norm) in sorted(sums.items())}


def _zero_plane(rows: int, in_features: int) -> Plane:
    """A plane that adds nothing (code 8, scale 0, zero 0): pads a member with fewer
    planes than its fused siblings."""
    groups = (rows, in_features // GROUP)
    codes = np.full((rows, in_features), 8, dtype=np.uint8)
    return Plane(codes, np.zeros(groups, np.float32), np.zeros(groups, np.float32))


class Int4Projections(SharedProjections):
    """Concatenated block weights as planes, multiplied by a ``PlaneKernel``. A forward
    of more than ``max_rows`` rows multiplies the de-quantised weight instead (in
    ``--dtype``), as vLLM's GGUF path does past a few rows: there the GEMM is bound by
    arithmetic, not by reading the weight, and the dense kernel is the faster."""

    method = METHOD
    max_rows = PACKED_MAX_ROWS  # set per instance from a measurement (``packed_rows``)

    def __init__(
        self,
        linears: list[nn.Linear],
        weights: list[BlockWeight],
        kernel: Callable[[list[Plane]], PlaneKernel] | None = plane_kernel,
    ) -> None:
        """``kernel`` None: ``use`` names it later (``pack_model`` chooses by shape)."""
        super().__init__(linears)
        # One member keeps its own tensor (a tied head's is the embedding's: no copy).
        dense = [linear.weight.detach() for linear in linears]
        self.dense = dense[0] if len(dense) == 1 else torch.cat(dense)
        depth = max(len(w.planes) for w in weights)
        planes = []
        for p in range(depth):
            members = [w.planes[p] if p < len(w.planes) else _zero_plane(*w.shape) for w in weights]
            planes.append(
                Plane(
                    np.concatenate([m.codes for m in members]),
                    np.concatenate([m.scale for m in members]),
                    np.concatenate([m.zero for m in members]),
                )
            )
        self.depth = depth
        self.planes: list[Plane] | None = planes  # until a kernel holds them
        self.kernel: PlaneKernel | None = None
        if kernel is not None:
            self.use(kernel)

    def use(self, kernel: Callable[[list[Plane]], PlaneKernel]) -> None:
        """Multiply by ``kernel``, built over the planes (then dropped)."""
        assert self.planes is not None, "a kernel was chosen already"
        self.kernel = kernel(self.planes)
        self.planes = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """(out, in, planes): what a packed product's speed depends on."""
        out_features, in_features = self.dense.shape
        return int(out_features), int(in_features), self.depth

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] > self.max_rows:
            return self.dense_product(rows)
        return self.packed_product(rows)

    def dense_product(self, rows: torch.Tensor) -> torch.Tensor:
        return prepacked_dense.linear(rows, self.dense)

    def prepack_dense(self) -> None:
        """Keep the de-quantised weight in oneDNN's layout (``prepacked_dense``); a tied
        head's embedding keeps its plain tensor beside it."""
        self.dense = prepacked_dense.prepack(self.dense)

    def packed_product(self, rows: torch.Tensor) -> torch.Tensor:
        assert self.kernel is not None, "no kernel chosen"
        return self.kernel.product(rows)


def packed_projections(model: Any) -> list[Int4Projections]:
    # Members share a projection (q, k and v one GEMM): each projection counted once.
    shared = (m.shared for m in model.modules() if isinstance(m, ProjectionMember))
    return list({id(p): p for p in shared if isinstance(p, Int4Projections)}.values())


PREPACKED = "oneDNN's blocked layout, reordered at load"


def prepack_dense(model: Any, allowed: bool) -> str:
    """Reorder the packed projections' de-quantised weights for oneDNN where it
    multiplies their dtype and ``allowed`` (not where ``torch.compile`` traces the
    step); returns the layout kept, and why."""
    projections = packed_projections(model)
    if not projections:
        return "none de-quantised"
    dtype = projections[0].dense.dtype
    if not allowed:
        return "plain: --enable-torch-compile traces the weights"
    if not prepacked_dense.prepacks(dtype):
        return f"plain: oneDNN here does not multiply {str(dtype).removeprefix('torch.')}"
    for projection in projections:
        projection.prepack_dense()
    return PREPACKED


def pack_model(
    model: Any,
    folder: Path,
    source: Path,
    kernel: Callable[[list[Plane]], PlaneKernel] | None = plane_kernel,
) -> PackingReport:
    """Replace the linears whose file type packs (the LM head included; MoE routers
    not) in place with packed ones, multiplied by ``kernel`` (None: chosen after, by
    ``kernel_choice.choose_kernels``); the report counts both by file type."""
    tensors = block_tensors(model, folder, source)
    # Weights by identity: a tied LM head is its embedding, under the embedding's name.
    params = dict(model.named_parameters(remove_duplicate=False))
    blocks = {id(params[n]): w for n, w in tensors.packable.items() if n in params}
    file_types = {id(params[n]): t for n, t in tensors.types.items() if n in params}

    def takes(name: str, linear: nn.Linear) -> bool:
        weight = blocks.get(id(linear.weight))
        return (
            name.rsplit(".", 1)[-1] not in ROUTERS
            and weight is not None
            and weight.shape == tuple(linear.weight.shape)
        )

    def build(group: list[tuple[str, nn.Linear]]) -> SharedProjections:
        linears = [linear for _, linear in group]
        return Int4Projections(linears, [blocks[id(linear.weight)] for linear in linears], kernel)

    linears = [module for module in model.modules() if type(module) is nn.Linear]
    replace_linears(model, takes, build)
    still_dense = {id(module) for module in model.modules() if type(module) is nn.Linear}
    packed: Counter[str] = Counter()
    dense: Counter[str] = Counter()
    served: list[BlockWeight] = []
    for linear in linears:
        file_type = file_types.get(id(linear.weight), "not in the file")
        (dense if id(linear) in still_dense else packed)[file_type] += 1
        if id(linear) not in still_dense:
            served.append(blocks[id(linear.weight)])
    return PackingReport(
        dict(sorted(packed.items())), dict(sorted(dense.items())), requantisation_error(served)
    )


def block_tensors(model: Any, folder: Path, source: Path) -> GgufTensors:
    """The file's packable blocks, from the cache beside the converted model where it
    is there, else decoded from ``source``, checked against ``model``'s weights and
    kept."""
    from safetensors import SafetensorError

    cached = folder / CACHE_FILE
    if cached.is_file():
        try:
            return _read_cache(cached)
        except (OSError, ValueError, KeyError, SafetensorError) as exc:
            log.warning("re-reading the GGUF: its block cache is unreadable", error=str(exc))
    tensors = read_gguf_tensors(source, model)
    _check_against(model, tensors, source)
    try:
        _write_cache(cached, tensors)
    except OSError as exc:  # a read-only models folder decodes again next start
        log.warning("cannot keep the GGUF's blocks", path=str(cached), error=str(exc))
    return tensors


def _check_against(model: Any, tensors: GgufTensors, source: Path) -> None:
    """Each decoded weight equals the one transformers de-quantised from the same file
    (it would not if a row order or a name were wrong), both rounded to the dtype the
    model was loaded in: a bfloat16 model holds the file's values to bf16's precision.
    A re-quantised weight may be one 8-bit step further off."""
    weights = dict(model.named_parameters(remove_duplicate=False))
    for name, weight in tensors.packable.items():
        loaded = weights.get(name)
        if loaded is None:
            continue
        expected = loaded.detach().float()
        ours = torch.from_numpy(weight.dequantize()).to(loaded.dtype).float()
        # One unit in the last place of the model's dtype (fp32: a millionth).
        rtol = 1e-6 if loaded.dtype == torch.float32 else torch.finfo(loaded.dtype).eps
        allowed = torch.from_numpy(weight.requantisation_bound()) + rtol * expected.abs() + 1e-6
        if ours.shape != expected.shape or not bool(((ours - expected).abs() <= allowed).all()):
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
    for name, weight in tensors.packable.items():
        for p, plane in enumerate(weight.planes):
            arrays[f"{name}:{p}:codes"] = _pack_nibbles(plane.codes)
            arrays[f"{name}:{p}:scale"] = plane.scale
            arrays[f"{name}:{p}:zero"] = plane.zero
    layout = {
        name: [w.file_type, len(w.planes), w.squared_error, w.squared_norm]
        for name, w in tensors.packable.items()
    }
    # A staging file of this process's own: ``--dp-size`` workers starting together
    # each decode and write, and the last whole file wins.
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    staging = Path(name)
    try:
        save_file(
            arrays,
            str(staging),
            metadata={"types": json.dumps(tensors.types), "packable": json.dumps(layout)},
        )
        staging.replace(path)
    finally:
        staging.unlink(missing_ok=True)
    for old in _OLD_CACHE_FILES:
        (path.parent / old).unlink(missing_ok=True)


def _read_cache(path: Path) -> GgufTensors:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata()
        layout: dict[str, list[Any]] = json.loads(metadata["packable"])
        packable = {
            name: BlockWeight(
                tuple(
                    Plane(
                        codes=_unpack_nibbles(f.get_tensor(f"{name}:{p}:codes")),
                        scale=f.get_tensor(f"{name}:{p}:scale"),
                        zero=f.get_tensor(f"{name}:{p}:zero"),
                    )
                    for p in range(int(depth))
                ),
                str(file_type),
                float(squared_error),
                float(squared_norm),
            )
            for name, (file_type, depth, squared_error, squared_norm) in layout.items()
        }
    return GgufTensors(json.loads(metadata["types"]), packable)

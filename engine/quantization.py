"""``--quantization``: which weights are served quantised, chosen once and said.

- ``gguf`` (the default for a GGUF file of packable types, on the CPU): the file's own
  Q4_0 / Q4_1 / Q4_K / Q5_0 / Q8_0 blocks, multiplied packed (``engine/gguf_packed.py``),
  as llama.cpp and vLLM's GGUF loader serve such a file; Q6_K re-quantised to 8 bits
  per 32 weights, with its distance from the file's weights reported.
- ``w8a8_int8``: int8 weights and activations (``engine/int8_projections.py``),
  SGLang's method, for any model.
- ``none``: the de-quantised weights in ``--dtype`` (what a transformers folder gets,
  and what every test that pins ``model.generate`` runs).

The choice and why it was made go to the start-up log and ``/server_info`` (with how
many linears of each file type were packed); ``/v1/models`` names the method.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from .errors import ModelLoadError
from .fused_projections import ROUTERS, replace_linears
from .gguf_blocks import PACKABLE_TYPES
from .int8_projections import MAX_IN_FEATURES, Int8Projections
from .platform import platform

if TYPE_CHECKING:
    from .kernel_choice import KernelChoice
    from .packed_rows import PackedRows

NONE, GGUF, W8A8_INT8 = "none", "gguf", "w8a8_int8"
FLAG = "--quantization"  # the reason of a method asked for by name
_PACKABLE = ", ".join(PACKABLE_TYPES[:-1]) + " or " + PACKABLE_TYPES[-1]


@dataclass(frozen=True)
class QuantizationChoice:
    """The method in effect, why, and (for ``gguf``) what was packed by file type."""

    method: str
    reason: str
    packed: dict[str, int] | None = None  # file type → linears served packed
    dense: dict[str, int] | None = None  # file type → linears left de-quantised
    # A file type packed re-quantised → its weights' relative RMS distance from the file's.
    requantised: dict[str, float] | None = None
    packed_rows: PackedRows | None = None  # up to how many rows each shape runs packed
    kernels: KernelChoice | None = None  # each shape's packed GEMM, and why
    dense_layout: str | None = None  # how the de-quantised weights beside are kept, and why

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"method": self.method, "reason": self.reason}
        if self.packed is not None:
            out |= {"packed": self.packed, "dense": self.dense, "requantised": self.requantised}
        if self.packed_rows is not None:
            out["packed_rows"] = self.packed_rows.to_dict()
        if self.kernels is not None:
            out["kernels"] = self.kernels.to_dict()
        if self.dense_layout is not None:
            out["dense_layout"] = self.dense_layout
        return out


def check_quantization(method: str, device: str) -> None:
    """Raise ``ModelLoadError`` for a method or device the engine cannot take (called
    before the model loads, so that a wrong flag fails fast)."""
    if method not in APPLY:
        raise ModelLoadError(f"unknown --quantization {method!r}: choose from {', '.join(APPLY)}")
    if method != NONE and not platform(device).packed_quantization:
        raise ModelLoadError(
            f"--quantization {method} runs on the CPU (its packed GEMMs); on {device} serve "
            "bfloat16 instead (--quantization none)"
        )


def choose_quantization(
    flag: str | None, source: Path, matrix_types: frozenset[str], device: str
) -> QuantizationChoice:
    """The flag where given (checked); else ``gguf`` for a GGUF file holding matrices of
    a packable type on the CPU, else ``none``, each with its reason."""
    if flag is not None:
        check_quantization(flag, device)
        if flag == GGUF and not matrix_types & set(PACKABLE_TYPES):
            held = ", ".join(sorted(matrix_types)) or "no GGUF matrices"
            raise ModelLoadError(
                f"--quantization gguf serves a GGUF file's {_PACKABLE} weights; "
                f"{source.name} holds {held}"
            )
        return QuantizationChoice(flag, FLAG)
    if source.suffix != ".gguf":
        return QuantizationChoice(NONE, "a transformers folder: its weights as stored")
    packable = sorted(matrix_types & set(PACKABLE_TYPES))
    if not packable:
        return QuantizationChoice(NONE, f"the GGUF holds no {_PACKABLE} weights")
    if not platform(device).packed_quantization:
        return QuantizationChoice(NONE, f"the packed 4-bit GEMM runs on the CPU, not {device}")
    return QuantizationChoice(GGUF, f"a GGUF file of {', '.join(packable)} weights")


def apply_quantization(
    model: Any, choice: QuantizationChoice, folder: Path, source: Path, *, compiled: bool = False
) -> QuantizationChoice:
    """Quantise ``model`` in place as chosen (``folder``: its transformers files,
    ``source``: the file it came from; ``compiled``: ``torch.compile`` will trace its
    step); returns the choice with what was done."""
    return APPLY[choice.method](model, choice, folder, source, compiled=compiled)


class Apply(Protocol):
    """A method's application: ``model`` quantised in place, and the choice with what
    was done."""

    def __call__(
        self, model: Any, choice: QuantizationChoice, folder: Path, source: Path, *, compiled: bool
    ) -> QuantizationChoice:
        """See ``apply_quantization``."""


def _as_stored(
    model: Any, choice: QuantizationChoice, folder: Path, source: Path, *, compiled: bool
) -> QuantizationChoice:
    return choice


def _apply_int8(
    model: Any, choice: QuantizationChoice, folder: Path, source: Path, *, compiled: bool
) -> QuantizationChoice:
    quantize_model(model, W8A8_INT8, "cpu")
    return choice


def _apply_gguf(
    model: Any, choice: QuantizationChoice, folder: Path, source: Path, *, compiled: bool
) -> QuantizationChoice:
    """The file's own blocks, packed, with what was packed by file type, how the
    de-quantised weights beside them are kept (``prepacked_dense``), and up to how
    many rows each projection runs packed on this machine (measured once and kept
    beside the precision decision)."""
    from .gguf_packed import pack_model, prepack_dense
    from .kernel_choice import choose_kernels
    from .packed_rows import calibrate
    from .precision import default_cache_dir

    report = pack_model(model, folder, source, kernel=None)
    if not report.packed:  # the packable tensors were an embedding, say, not linears
        linears = ", ".join(sorted(report.dense)) or "none"
        if choice.reason == FLAG:
            raise ModelLoadError(
                f"--quantization gguf: {source.name} holds no {_PACKABLE} linear weights "
                f"(its linears are {linears})"
            )
        return QuantizationChoice(NONE, f"the GGUF's linears are {linears}: none packs")
    dense_layout = prepack_dense(model, allowed=not compiled)
    kernels = choose_kernels(model, default_cache_dir())
    rows = calibrate(model, default_cache_dir())
    return replace(
        choice,
        packed=report.packed,
        dense=report.dense,
        requantised=report.requantised,
        packed_rows=rows,
        kernels=kernels,
        dense_layout=dense_layout,
    )


APPLY: dict[str, Apply] = {NONE: _as_stored, GGUF: _apply_gguf, W8A8_INT8: _apply_int8}
"""The seam: a ``--quantization`` method is its name here and what applying it does
(replacing linears with a ``fused_projections.SharedProjections`` subclass of its own,
through ``replace_linears``); ``tests/engine/test_quantization.py`` adds a toy one."""
QUANTIZATION_METHODS = tuple(APPLY)


def quantize_model(model: Any, method: str, device: str) -> int:
    """Replace the decoder's linears with int8 ones in place (``w8a8_int8``); returns
    how many were replaced. (``gguf`` is ``engine.gguf_packed.pack_model``: it needs
    the file.)"""
    check_quantization(method, device)
    if method != W8A8_INT8:
        raise ModelLoadError(f"--quantization {method} is not applied by quantize_model")
    head = model.get_output_embeddings()

    def takes(name: str, linear: nn.Linear) -> bool:
        if linear is head or name.rsplit(".", 1)[-1] in ROUTERS:
            return False
        if linear.in_features > MAX_IN_FEATURES:
            raise ModelLoadError(
                f"--quantization {method}: a linear reads more than {MAX_IN_FEATURES} "
                "features, past what its int32 sums hold"
            )
        return True

    replaced = replace_linears(
        model, takes, lambda group: Int8Projections([linear for _, linear in group])
    )
    if replaced == 0:
        raise ModelLoadError(f"--quantization {method}: the model has no linear layers to quantise")
    return replaced

"""Finding, converting and loading a model: a GGUF file or a transformers folder.

A GGUF file is de-quantised by ``transformers`` on first use (~25 s for the default
model) and the result is cached beside it as a safetensors folder keyed by the
file's checksum, so later starts load in seconds.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from .errors import ModelLoadError as ModelLoadError  # raised here, caught from here

log = structlog.get_logger(__name__)

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def default_models_dir() -> Path:
    return Path(os.environ.get("SLUICE_MODELS_DIR", "models")).resolve()


def default_model_path() -> Path:
    return default_models_dir() / DEFAULT_MODEL_FILE


def model_display_name(path: Path) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` → ``SmolLM2-135M-Instruct``."""
    name = path.name
    if name.endswith(".gguf"):
        name = name[: -len(".gguf")]
        name = re.sub(r"[.-](Q\d\w*|F16|F32|BF16)$", "", name, flags=re.IGNORECASE)
    return name


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class ResolvedModel:
    """A transformers folder ready to load, and where it came from."""

    folder: Path
    source: Path
    name: str
    # A GGUF's types of its 2-D (matrix) tensors, e.g. ("F32", "Q4_1", "Q8_0"); none
    # for a transformers folder.
    matrix_types: frozenset[str] = frozenset()


def _checksum_file(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def gguf_cache_folder(gguf: Path) -> Path:
    """The converted folder for a GGUF file, keyed by its (memoised) sha256."""
    sums = _checksum_file(gguf)
    stat = gguf.stat()
    stamp = f"{stat.st_size}:{int(stat.st_mtime)}"
    digest = None
    if sums.exists():
        recorded_stamp, _, recorded = sums.read_text().strip().partition(" ")
        if recorded_stamp == stamp:
            digest = recorded
    if digest is None:
        digest = file_sha256(gguf)
        sums.write_text(f"{stamp} {digest}\n")
    return gguf.parent / "cache" / f"{model_display_name(gguf)}-{digest[:16]}"


def resolve_model(model_path: str | Path | None) -> ResolvedModel:
    path = Path(model_path) if model_path is not None else default_model_path()
    if not path.exists():
        hint = " Run `make model` to fetch the default model." if model_path is None else ""
        raise ModelLoadError(f"model path {str(path)!r} does not exist.{hint}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{str(path)!r} is a folder without a config.json")
        return ResolvedModel(path, path, path.name)
    if path.suffix != ".gguf":
        raise ModelLoadError(f"{str(path)!r} is neither a .gguf file nor a transformers folder")
    matrix_types = check_gguf(path)
    folder = gguf_cache_folder(path)
    if not (folder / "config.json").is_file():
        _convert_gguf(path, folder)
    return ResolvedModel(folder, path, model_display_name(path), matrix_types)


def check_gguf(path: Path) -> frozenset[str]:
    """The types of a GGUF's matrix tensors. A file that is not a whole GGUF is a
    one-line ``ModelLoadError`` naming it and what is wrong (``gguf``'s reader fails
    with a bare ``ValueError`` or ``IndexError``, and transformers with a
    ``struct.error``, on a truncated file)."""
    import struct

    from gguf import GGUFReader

    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{str(path)!r} is not a GGUF file: it starts with {magic!r}")
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, struct.error, OSError) as exc:
        raise ModelLoadError(
            f"{str(path)!r} is a truncated or corrupt GGUF file ({size:,} bytes): {exc}"
        ) from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ModelLoadError(
            f"{str(path)!r} is truncated: its tensors end at byte {end:,}, the file at {size:,}"
        )
    return frozenset(t.tensor_type.name for t in reader.tensors if len(t.shape) == 2)


def _convert_gguf(gguf: Path, folder: Path) -> None:
    """De-quantise ``gguf`` into a safetensors folder, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting GGUF (first start only)", gguf=str(gguf), cache=str(folder))
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot read GGUF {str(gguf)!r}: {exc}") from exc
        # The weights are plain tensors after de-quantisation; drop the GGUF marker so
        # transformers agrees to serialise them.
        model.hf_quantizer = None  # type: ignore[assignment]
        del model.config.quantization_config
        model.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
        staging.rename(folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def load_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {str(folder)!r}: {exc}") from exc


# (out, in, how many): a stand-in for a model whose config lacks the usual keys.
_GENERIC_SHAPES = ((4096, 1024, 1),)
# Measured weights are cut to this many elements (64 MB in fp32): a 7B model's
# would take seconds to fill, and a GEMM's kernel choice is settled well below it.
_MAX_MEASURED_ELEMENTS = 1 << 24


def gemm_shapes(folder: Path, *, quantized: bool = False) -> tuple[tuple[int, int, int], ...]:
    """The GEMMs a decode step runs in ``--dtype`` (the precision measurement's shapes):
    the model's own, read from its config (the same kernels at other shapes disagreed:
    bf16 ×4–5 faster on a 1024 × 4096 weight, ×0.7–1.0 on SmolLM2's). With int8
    projections (``quantized``) only the LM head is left in ``--dtype``."""
    from transformers import AutoConfig

    try:
        shapes = decoder_linear_shapes(AutoConfig.from_pretrained(str(folder)))
    except (OSError, ValueError):
        shapes = None
    if shapes is None:
        return _GENERIC_SHAPES
    return shapes[-1:] if quantized else shapes


def decoder_linear_shapes(config: Any) -> tuple[tuple[int, int, int], ...] | None:
    """(out, in, how many) of a decoder's projections and its LM head, from the usual
    config keys; None where they are missing."""
    config = getattr(config, "text_config", None) or config
    try:
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        inner = int(config.intermediate_size)
        layers = int(config.num_hidden_layers)
        vocab = int(config.vocab_size)
    except (AttributeError, TypeError, ValueError):
        return None
    return (
        (heads * head_dim, hidden, 2 * layers),  # q, and o transposed: the same bytes
        (kv_heads * head_dim, hidden, 2 * layers),  # k, v
        (inner, hidden, 3 * layers),  # gate, up, and down transposed
        (vocab, hidden, 1),
    )


def measured_bf16_speedup(shapes: tuple[tuple[int, int, int], ...]) -> float:
    """fp32 ÷ bf16 time of a decode step's GEMMs at 1 and 16 rows: each shape timed
    alone (medians of interleaved repeats), weighted by how often a step runs it;
    ≈0.1–0.5 s (``engine.precision`` repeats it and keeps the outcome)."""
    import torch

    dtypes = (torch.float32, torch.bfloat16)
    total = dict.fromkeys(dtypes, 0.0)
    with torch.inference_mode():
        for out_features, in_features, count in shapes:
            rows = max(1, min(out_features, _MAX_MEASURED_ELEMENTS // in_features))
            weights = {dtype: torch.randn(rows, in_features).to(dtype) for dtype in dtypes}
            inputs = {
                (dtype, m): torch.randn(m, in_features).to(dtype)
                for dtype in dtypes
                for m in (1, 16)
            }
            times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in dtypes}
            for repeat in range(7):
                for dtype in dtypes:
                    begin = time.perf_counter()
                    for m in (1, 16):
                        torch.nn.functional.linear(inputs[dtype, m], weights[dtype])
                    if repeat >= 2:  # the first two warm the kernels up
                        times[dtype].append(time.perf_counter() - begin)
            scale = count * out_features / rows
            for dtype in dtypes:
                total[dtype] += scale * statistics.median(times[dtype])
    return total[torch.float32] / total[torch.bfloat16]


def load_causal_lm(folder: Path, *, dtype: str, device: str) -> Any:
    """Load with SDPA attention where the model allows it, else eager attention (the
    models that soft-cap attention scores, or that transformers refuses SDPA for)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from .attention import attention_implementation

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        dtype
    ]
    model: Any
    try:
        implementation = attention_implementation(AutoConfig.from_pretrained(str(folder)))
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=torch_dtype, attn_implementation=implementation
            )
        except ValueError as exc:
            if implementation != "sdpa" or "scaled_dot_product_attention" not in str(exc):
                raise
            log.info("the model refuses SDPA attention; attending eagerly", folder=str(folder))
            model = AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=torch_dtype, attn_implementation="eager"
            )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the model from {str(folder)!r}: {exc}") from exc
    model.to(torch.device(device))
    model.eval()
    return model

"""What the benches that drive the engine in this process share: the model flags, and
the model loaded the way the server loads it."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sluice.engine.host_memory import keep_freed_memory
from sluice.engine.loader import gemm_shapes, load_causal_lm, load_tokenizer, resolve_model
from sluice.engine.precision import choose_precision, default_cache_dir
from sluice.engine.quantization import (
    NONE,
    QUANTIZATION_METHODS,
    QuantizationChoice,
    apply_quantization,
    choose_quantization,
)


@dataclass(frozen=True)
class BenchModel:
    folder: Path
    source: Path
    tokenizer: Any
    dtype: str
    quantization: QuantizationChoice

    def load(self, quantization: str | None = None) -> Any:
        """A fresh copy of the weights (a bench comparing two models loads twice),
        quantised as chosen, or by ``quantization``'s method where given."""
        model = load_causal_lm(self.folder, dtype=self.dtype, device="cpu")
        choice = self.quantization
        if quantization is not None:
            choice = QuantizationChoice(quantization, "the bench")
        apply_quantization(model, choice, self.folder, self.source)
        return model


def add_model_args(
    p: argparse.ArgumentParser, *, dtype: str = "auto", quantization: str | None = None
) -> None:
    p.add_argument("--model-path")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=dtype)
    p.add_argument(
        "--quantization",
        choices=QUANTIZATION_METHODS,
        default=quantization,
        help="as the server's flag (default: as the server chooses)",
    )


def bench_model(args: argparse.Namespace) -> BenchModel:
    """Set the threads and the host allocator, and resolve the model, its quantisation
    and its precision, as the server does (``auto`` timing bf16 against fp32 at the
    model's own GEMM shapes)."""
    torch.set_num_threads(args.threads)
    print(f"host memory: {keep_freed_memory()}", file=sys.stderr)
    resolved = resolve_model(args.model_path)
    quantization = choose_quantization(
        args.quantization, resolved.source, resolved.matrix_types, "cpu"
    )
    quantized = quantization.method != NONE
    precision = choose_precision(
        args.dtype,
        "cpu",
        lambda: gemm_shapes(resolved.folder, quantized=quantized),
        cache_dir=default_cache_dir(),
    )
    print(f"quantization: {quantization.method} ({quantization.reason})", file=sys.stderr)
    print(f"precision: {precision.line()}", file=sys.stderr)
    tokenizer = load_tokenizer(resolved.folder)
    return BenchModel(resolved.folder, resolved.source, tokenizer, precision.dtype, quantization)

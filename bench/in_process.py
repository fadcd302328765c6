"""What the benches that drive the engine in this process share: the model flags, and
the model loaded the way the server loads it."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sluice.engine.loader import gemm_shapes, load_causal_lm, load_tokenizer, resolve_model
from sluice.engine.precision import choose_precision, default_cache_dir


@dataclass(frozen=True)
class BenchModel:
    folder: Path
    tokenizer: Any
    dtype: str

    def load(self) -> Any:
        """A fresh copy of the weights (a bench comparing two models loads twice)."""
        return load_causal_lm(self.folder, dtype=self.dtype, device="cpu")


def add_model_args(p: argparse.ArgumentParser, *, dtype: str = "auto") -> None:
    p.add_argument("--model-path")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=dtype)


def bench_model(args: argparse.Namespace) -> BenchModel:
    """Set the threads and resolve the model and its precision (``auto`` as the server
    resolves it, timing bf16 against fp32 at the model's own GEMM shapes)."""
    torch.set_num_threads(args.threads)
    folder = resolve_model(args.model_path).folder
    precision = choose_precision(
        args.dtype, "cpu", lambda: gemm_shapes(folder), cache_dir=default_cache_dir()
    )
    print(f"precision: {precision.line()}", file=sys.stderr)
    return BenchModel(folder, load_tokenizer(folder), precision.dtype)

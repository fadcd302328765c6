"""What the benches that drive the engine in this process share: the model flags, and
the model loaded the way the server loads it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sluice.engine.loader import (
    bf16_speedup_for,
    load_causal_lm,
    load_tokenizer,
    resolve_dtype,
    resolve_model,
)


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
    dtype = resolve_dtype(args.dtype, "cpu", bf16_speedup=bf16_speedup_for(folder))
    return BenchModel(folder, load_tokenizer(folder), dtype)

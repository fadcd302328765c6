"""The packed GEMM kernels torch ships for the CPU, at a model's own decode shapes:
what serving a GGUF's own quantised weights could gain before any of it is built.

    python -P -m sluice.bench.packed_kernels [--model-path …] [--rows 1,4,16] [--threads 2]

For each batch size, one decode step's GEMMs (each projection of every layer and the
LM head, weighted by how often a step runs it) timed interleaved in: fp32 and bf16
``linear`` (what Sluice runs now), ``_weight_int4pack_mm_for_cpu`` with group 32 (what
a Q4_0 / Q4_1 block is; bf16 activations, as its fast path wants) and
``_weight_int8pack_mm`` (int8 weights, one scale per output channel; bf16
activations). Random weights: a kernel's speed does not depend on the values. Prints
the time per step of each and its ratio to fp32, and the machine line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from sluice.bench.machine import print_machine
from sluice.engine.loader import gemm_shapes, resolve_model

GROUP = 32  # a GGUF Q4_0 / Q4_1 / Q8_0 block
KERNELS = ("fp32", "bf16", "int4 g32", "int8 channel")


def kernels(out_features: int, in_features: int, rows: int) -> dict[str, Callable[[], object]]:
    """Each kernel's GEMM of ``rows`` activations by one ``out × in`` weight."""
    ops = torch.ops.aten
    weight = torch.randn(out_features, in_features)
    x32 = torch.randn(rows, in_features)
    xb = x32.to(torch.bfloat16)
    wb = weight.to(torch.bfloat16)
    nibbles = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32)
    packed = ops._convert_weight_to_int4pack_for_cpu(nibbles, 8)
    scales_zeros = torch.randn(in_features // GROUP, out_features, 2).to(torch.bfloat16)
    int8 = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    channel = torch.rand(out_features).to(torch.bfloat16)
    return {
        "fp32": lambda: torch.nn.functional.linear(x32, weight),
        "bf16": lambda: torch.nn.functional.linear(xb, wb),
        "int4 g32": lambda: ops._weight_int4pack_mm_for_cpu(xb, packed, GROUP, scales_zeros),
        "int8 channel": lambda: ops._weight_int8pack_mm(xb, int8, channel),
    }


def step_times(
    shapes: tuple[tuple[int, int, int], ...], rows: int, repeats: int
) -> dict[str, float]:
    """Seconds a decode step spends in its GEMMs, per kernel: each shape's median of
    interleaved repeats (the first two warm up), times how often a step runs it."""
    total = dict.fromkeys(KERNELS, 0.0)
    with torch.inference_mode():
        for out_features, in_features, count in shapes:
            calls = kernels(out_features, in_features, rows)
            times: dict[str, list[float]] = {name: [] for name in KERNELS}
            for repeat in range(repeats + 2):
                for name, call in calls.items():
                    begin = time.perf_counter()
                    call()
                    if repeat >= 2:
                        times[name].append(time.perf_counter() - begin)
            for name in KERNELS:
                total[name] += count * statistics.median(times[name])
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="packed_kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    print_machine()
    torch.set_num_threads(args.threads)
    folder = resolve_model(args.model_path).folder
    shapes = gemm_shapes(folder)
    print(f"model {folder.name}, {args.threads} threads; GEMM shapes (out, in, per step): {shapes}")
    header = "".join(f"{name + ' ms':>16}" for name in KERNELS)
    print(f"{'rows':>5}{header}   fp32 ÷ bf16, int4, int8")
    for rows in (int(r) for r in args.rows.split(",")):
        total = step_times(shapes, rows, args.repeats)
        ratios = " ".join(f"{total['fp32'] / total[name]:.2f}" for name in KERNELS[1:])
        cells = "".join(f"{total[name] * 1000:>16.2f}" for name in KERNELS)
        print(f"{rows:>5}{cells}   {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

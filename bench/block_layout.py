"""Sluice's packed kernel in its two weight layouts, against the de-quantised bfloat16
weight, at the default models' projection shapes: what the sixteen-row blocks of
``engine/kernels/blocks_mm.cpp`` change at each row count.

    python -P -m sluice.bench.block_layout [--shapes 262144x640:8,960x576:4] [--rows 1,4,16,64]

For each shape (``out x in : bits``; 8-bit codes are what Q8_0, Q5_0 and re-quantised
Q6_K are held as, 4-bit what Q4_0, Q4_1 and Q4_K are) and row count, four products
of the same random weight are timed interleaved, each from emptied caches (as a
decode step reads every weight from memory): ``planes_mm`` over the row-major layout
(a weight row at a time), the same op over the blocked layout (what a build with
AVX-512 VNNI holds; 8-bit codes centred, as Q8_0's are held), the blocked layout
keeping each group's offset (``offsets``: how 8-bit blocks were held before
2026-12-05; the same kernel as ``blocks`` for 4-bit ones), and the bfloat16 weight as
the server keeps it (what a projection switches to past its measured row limit; in
oneDNN's layout, ``prepacked_dense``, where oneDNN multiplies bf16: plain ``linear``
before 2026-12-05). Prints medians in ms, the row-major ÷ blocked, offsets ÷ blocked
and dense ÷ blocked ratios, and the machine line. ``--isa avx512``
runs as on a CPU without AMX (``bench/emulated_isa.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from sluice.bench.emulated_isa import add_isa_argument, emulate
from sluice.bench.machine import print_machine
from sluice.engine import prepacked_dense
from sluice.engine.gguf_blocks import Plane
from sluice.engine.host_memory import keep_freed_memory
from sluice.engine.native_kernels import planes_kernel
from sluice.engine.packed_rows import CacheFlush
from sluice.engine.plane_kernels import OwnPlanes

# Gemma 3 270M's (Q4_K_M: the head, q/k/v, gate/up and most down projections 8-bit)
# and SmolLM2-135M's (Q4_1: the layers 4-bit, the tied head 8-bit).
DEFAULT_SHAPES = (
    "262144x640:8,4096x640:8,1536x640:8,640x2048:8,640x1024:4,"
    "49152x576:8,3072x576:4,960x576:4,576x1536:4"
)


def planes(out_features: int, in_features: int, bits: int, seed: int) -> list[Plane]:
    """Random planes: two that are one byte's nibbles (the high scale 16 x the low one)
    for 8 bits, as Q8_0's (so held centred), one for 4 (whose offset, 16 scales, keeps
    it off-centre: the kernel then takes each group's offset, as for Q4_1 and Q4_K)."""
    rng = np.random.default_rng(seed)
    groups = (out_features, in_features // 32)
    scale = (rng.random(groups) * 0.01).astype(np.float32)
    zero = np.zeros(groups, np.float32)

    def codes() -> np.ndarray:
        return rng.integers(0, 16, (out_features, in_features)).astype(np.uint8)

    if bits == 4:
        return [Plane(codes(), scale, -8 * scale)]
    return [Plane(codes(), 16 * scale, zero), Plane(codes(), scale, 8 * scale)]


def products(shape: str, rows: int) -> dict[str, Callable[[], object]]:
    sizes, bits = shape.split(":")
    out_features, in_features = (int(n) for n in sizes.split("x"))
    made = planes(out_features, in_features, int(bits), seed=rows)
    blocked, offsets = OwnPlanes(made), OwnPlanes(made, centred=False)
    if not blocked.blocked:
        raise SystemExit(f"{shape}: this build holds no blocks (no AVX-512 VNNI, or rows % 16)")
    scales, offset = (t.contiguous() for t in blocked.row_major_values())
    if blocked.bytes:
        row_major = torch.from_numpy((16 * made[0].codes + made[1].codes)[None])
    else:
        halves = made[0].codes.reshape(out_features, -1, 2, 16)
        row_major = torch.from_numpy((halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(
            1, out_features, in_features // 2))  # fmt: skip
    dense = torch.from_numpy(blocked.held_weight(made)).to(torch.bfloat16)
    if prepacked_dense.prepacks(dense.dtype):  # as the server keeps it
        dense = prepacked_dense.prepack(dense)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    planes_mm = torch.ops.sluice_kernels.planes_mm
    return {
        "row-major": lambda: planes_mm(x, row_major, scales, offset),
        "blocks": lambda: blocked.product(x),
        "offsets": lambda: offsets.product(x),
        "dense bf16": lambda: prepacked_dense.linear(x, dense),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="block_layout", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES)
    p.add_argument("--rows", default="1,4,8,16,32,64")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=7)
    add_isa_argument(p)
    args = p.parse_args(argv)
    emulate(args.isa, "sluice.bench.block_layout")
    torch.set_num_threads(args.threads)
    # As the server sets it. By default Gemma 3's 67 MB head output at 64 rows was mapped
    # and faulted in afresh at every product: 47-54 ms a product against 32-33 ms
    # (docs/benchmarks.md).
    print(f"host memory: {keep_freed_memory()}")
    unavailable = planes_kernel()
    if unavailable is not None:
        raise SystemExit(f"Sluice's kernels are unavailable: {unavailable}")
    print_machine()
    print(f"threads {args.threads}; medians of {args.repeats}, each product from emptied caches")
    amx = int(torch.ops.sluice_kernels.amx_rows())
    print(f"blocks multiplied by AMX's tiles from {amx} rows" if amx else "blocks: VNNI only")
    flush = CacheFlush()
    print(f"{'shape':>16} {'rows':>4} {'row-major':>10} {'blocks':>8} {'offsets':>8}"
          f" {'dense bf16':>10} {'row-major ÷ blocks':>19} {'offsets ÷ blocks':>17}"
          f" {'dense ÷ blocks':>15}")  # fmt: skip
    for shape in args.shapes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            kernels = products(shape, rows)
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for repeat in range(args.repeats + 1):  # the first a warm-up
                for name, kernel in kernels.items():
                    flush()
                    begin = time.perf_counter()
                    kernel()
                    if repeat:
                        times[name].append(time.perf_counter() - begin)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            print(f"{shape:>16} {rows:>4} {ms['row-major']:>10.3f} {ms['blocks']:>8.3f}"
                  f" {ms['offsets']:>8.3f} {ms['dense bf16']:>10.3f}"
                  f" {ms['row-major'] / ms['blocks']:>19.2f} {ms['offsets'] / ms['blocks']:>17.2f}"
                  f" {ms['dense bf16'] / ms['blocks']:>15.2f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

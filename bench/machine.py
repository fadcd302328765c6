"""The machine line every bench prints first and every report carries: the CPU (vendor,
model, the ISA flags that pick kernels) and the software that ran on it. Results from
two CPUs are not comparable, and a reader must be able to tell which one a figure is from."""

from __future__ import annotations

import platform
import sys
from typing import Any

from sluice.engine.cpu import host_cpu


def machine() -> dict[str, Any]:
    import torch

    from sluice.bench.emulated_isa import emulated

    # A run as on a CPU with less is this CPU's no more: its rows must not mix with them.
    isa = emulated()
    return {
        "cpu": host_cpu().to_dict(),
        "cpu_line": host_cpu().line() + (f" · as {isa} (emulated)" if isa else ""),
        "platform": platform.platform(),
        "cpus": host_cpu().logical_cpus,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def print_machine(file: Any = sys.stdout) -> None:
    """``cpu: GenuineIntel · Intel(R) Xeon(R) … · avx2 …`` and the torch build."""
    m = machine()
    print(f"cpu: {m['cpu_line']} (torch {m['torch']}, {m['cpu']['torch_capability']})", file=file)

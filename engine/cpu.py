"""The host CPU as the kernels see it: vendor, model and the ISA flags that pick them.

Two x86 machines can compute the same model differently (int8 and bf16 rounding,
accumulation order, which precision ``--dtype auto`` takes), so every benchmark result
and the server's own report name the CPU they came from."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path

# The flags oneDNN, MKL and torch's dispatch choose GEMM and attention kernels by.
KERNEL_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
)


@dataclass(frozen=True)
class CpuInfo:
    vendor: str
    model: str
    flags: frozenset[str]
    logical_cpus: int

    @property
    def kernel_flags(self) -> tuple[str, ...]:
        """The flags in ``KERNEL_FLAGS`` this CPU has, in that order."""
        return tuple(f for f in KERNEL_FLAGS if f in self.flags)

    @property
    def native_bf16(self) -> bool:
        """bf16 multiplied in hardware (AVX512-BF16 or AMX-BF16). oneDNN also runs bf16
        on plain AVX-512 by emulation, slower than fp32, so torch's ``mkldnn`` check
        (true there) is not this question."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    def line(self) -> str:
        """One line for a log or a report: ``GenuineIntel · Intel(R) Xeon(R) … · 2 CPUs ·
        avx2 fma avx512f …``."""
        flags = " ".join(self.kernel_flags) or "no SIMD flags read"
        return f"{self.vendor} · {self.model} · {self.logical_cpus} CPUs · {flags}"

    def to_dict(self) -> dict[str, object]:
        return {
            "vendor": self.vendor,
            "model": self.model,
            "logical_cpus": self.logical_cpus,
            "kernel_flags": list(self.kernel_flags),
            "torch_capability": torch_cpu_capability(),
        }


def parse_cpuinfo(text: str, logical_cpus: int) -> CpuInfo:
    """The first processor's fields of a ``/proc/cpuinfo`` text (x86 or Arm)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    vendor = fields.get("vendor_id") or fields.get("CPU implementer") or platform.machine()
    model = fields.get("model name") or fields.get("Model") or platform.processor() or "unknown"
    flags = fields.get("flags") or fields.get("Features") or ""
    return CpuInfo(vendor, model, frozenset(flags.split()), logical_cpus)


@cache
def host_cpu() -> CpuInfo:
    """This machine's CPU, read once."""
    import os

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return parse_cpuinfo(text, os.cpu_count() or 1)


def torch_cpu_capability() -> str:
    """The ISA level torch's own CPU kernels dispatch to (``AVX512``, ``AVX2``, …)."""
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"

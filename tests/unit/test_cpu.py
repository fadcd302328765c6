"""``engine/cpu.py``: the CPU line reports and ``--dtype auto`` read, from
``/proc/cpuinfo`` texts of an Intel, an AMD and an Arm machine."""

from __future__ import annotations

from sluice.engine.cpu import KERNEL_FLAGS, host_cpu, parse_cpuinfo

XEON = (
    "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\n"
    "flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 avx512_vnni amx_tile amx_bf16\n"
    "processor\t: 1\nvendor_id\t: GenuineIntel\nmodel name\t: other\n"
)
EPYC = (
    "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9B45\n"
    "flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni\n"
)
ARM = "processor\t: 0\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n"


def test_the_first_processors_fields_are_read() -> None:
    xeon = parse_cpuinfo(XEON, 2)
    assert (xeon.vendor, xeon.model, xeon.logical_cpus) == (
        "GenuineIntel",
        "Intel(R) Xeon(R) Processor",
        2,
    )
    assert xeon.kernel_flags == (
        "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
    )  # fmt: skip
    assert xeon.line() == (
        "GenuineIntel · Intel(R) Xeon(R) Processor · 2 CPUs · "
        "avx2 fma avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16"
    )


def test_vendors_are_told_apart() -> None:
    epyc = parse_cpuinfo(EPYC, 2)
    assert epyc.vendor == "AuthenticAMD" and "AMD EPYC" in epyc.line()
    assert epyc.native_bf16 and parse_cpuinfo(XEON, 2).native_bf16
    arm = parse_cpuinfo(ARM, 4)
    assert arm.kernel_flags == ("asimd", "sve") and not arm.native_bf16


def test_this_machine_is_described() -> None:
    cpu = host_cpu()
    assert cpu.logical_cpus >= 1 and cpu.vendor and cpu.model
    described = cpu.to_dict()
    assert set(described) == {"vendor", "model", "logical_cpus", "kernel_flags", "torch_capability"}
    assert set(described["kernel_flags"]) <= set(KERNEL_FLAGS)  # type: ignore[arg-type]

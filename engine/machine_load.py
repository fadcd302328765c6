"""How much of the machine's CPU time other processes took while this one measured.

A start-up measurement (precision, packed kernels, packed rows) is kept and reused by
every later start. One taken while other processes were busy would decide for good what
a quiet machine decides differently: on an Intel Xeon (2 vCPUs, emulated without AMX)
a Gemma 3 load beside another load measured packed-row limits of 0–32 rows where quiet
starts measured 1024 (docs/benchmarks.md). So the share of CPU time that others took
over the measurement is read from Linux's ``/proc/stat`` (every CPU's busy and total
time, steal included) less this process's own (``os.times``, children waited for
included). Above ``BUSY_SHARE``, ``precision.kept_decision`` keeps the outcome only for
the starts that raced it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

# Measured on that Xeon around 3 s of 2-thread matrix products: 0.002 on its own, 0.15
# beside one one-thread NumPy loop (pausing 50 ms every 20 products), 0.33 beside two.
BUSY_SHARE = 0.1
# Below this much of the machine's CPU time (seconds, all CPUs) the clock ticks are too
# coarse to tell: one 10 ms tick of another process would be a large share.
MIN_SECONDS = 0.5
PROC_STAT = Path("/proc/stat")
T = TypeVar("T")


@dataclass(frozen=True)
class CpuTimes:
    """Seconds of CPU time since boot, summed over every CPU: busy (steal included) and
    in all."""

    busy: float
    total: float


def machine_times(stat: Path = PROC_STAT) -> CpuTimes | None:
    """The machine's CPU times from the ``cpu`` line of ``stat`` (user nice system idle
    iowait irq softirq steal, in clock ticks); None where it cannot be read."""
    try:
        with stat.open() as lines:
            fields = lines.readline().split()
        ticks = [int(v) for v in fields[1:9]]
    except (OSError, ValueError):
        return None
    if fields[:1] != ["cpu"] or len(ticks) < 8:
        return None
    per_second = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + ticks[4]  # idle and iowait
    return CpuTimes(busy=(sum(ticks) - idle) / per_second, total=sum(ticks) / per_second)


def own_cpu_seconds() -> float:
    """CPU time of this process's threads, and of its children it has waited for (a
    kernel build)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def others_share(
    measure: Callable[[], T],
    machine: Callable[[], CpuTimes | None] = machine_times,
    own: Callable[[], float] = own_cpu_seconds,
) -> tuple[T, float | None]:
    """``measure()``, and the share of the machine's CPU time (0–1) that other
    processes took meanwhile (None where the machine's times cannot be read, or the
    measurement was too short to tell)."""
    before, own_before = machine(), own()
    result = measure()
    after, own_after = machine(), own()
    if before is None or after is None or after.total - before.total < MIN_SECONDS:
        return result, None
    others = (after.busy - before.busy) - (own_after - own_before)
    return result, min(1.0, max(0.0, others / (after.total - before.total)))

"""A start-up decision measured while other processes kept the CPUs busy
(``engine/machine_load.py``) serves the starts that raced it, and a later start
measures again (``precision.kept_decision``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from sluice.engine import precision
from sluice.engine.machine_load import (
    BUSY_SHARE,
    MIN_SECONDS,
    CpuTimes,
    machine_times,
    others_share,
)
from sluice.engine.precision import kept_decision


def test_the_machines_times_are_read_from_the_cpu_line(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  300 20 100 5000 80 10 10 60 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert machine_times(stat) == CpuTimes(busy=500 / tick, total=5580 / tick)


@pytest.mark.parametrize("text", ["", "intr 1 2 3\n", "cpu  1 2 x 4 5 6 7 8\n", "cpu  1 2 3\n"])
def test_a_stat_it_cannot_read_gives_no_times(tmp_path: Path, text: str) -> None:
    stat = tmp_path / "stat"
    stat.write_text(text)
    assert machine_times(stat) is None
    assert machine_times(tmp_path / "missing") is None


def times(*values: CpuTimes | None) -> Callable[[], CpuTimes | None]:
    """The machine's times at the start and at the end of a measurement."""
    it = iter(values)
    return lambda: next(it)


def seconds(*values: float) -> Callable[[], float]:
    """This process's CPU time at the start and at the end of a measurement."""
    it = iter(values)
    return lambda: next(it)


def test_others_share_is_the_machines_busy_time_less_this_processs_own() -> None:
    machine = times(CpuTimes(busy=10.0, total=100.0), CpuTimes(busy=70.0, total=200.0))
    own = seconds(5.0, 25.0)  # this process took 20 of the 60 busy seconds
    result, share = others_share(lambda: "decided", machine, own)
    assert result == "decided"
    assert share == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (None, CpuTimes(1.0, 2.0)),
        (CpuTimes(1.0, 2.0), None),
        (CpuTimes(1.0, 10.0), CpuTimes(1.0 + MIN_SECONDS / 2, 10.0 + MIN_SECONDS / 2)),
    ],
)
def test_no_share_where_the_times_are_unknown_or_too_short_to_tell(
    before: CpuTimes | None, after: CpuTimes | None
) -> None:
    _, share = others_share(lambda: 0, times(before, after), seconds(0.0, 0.0))
    assert share is None


def test_this_processs_own_work_is_no_one_elses() -> None:
    """Its own threads busy the whole time: others took nothing (clamped at 0 where the
    two clocks' ticks disagree by a little)."""
    machine = times(CpuTimes(0.0, 0.0), CpuTimes(2.0, 2.0))
    _, share = others_share(lambda: 0, machine, seconds(0.0, 2.01))
    assert share == 0.0


class Measurements:
    """Counts measurements; each says how busy the machine was meanwhile."""

    def __init__(self, shares: list[float | None]) -> None:
        self.shares = shares
        self.count = 0

    def measure(self) -> int:
        self.count += 1
        return self.count

    def watch(self, measure: Callable[[], int]) -> tuple[int, float | None]:
        decided = measure()
        return decided, self.shares[self.count - 1]

    def decide(self, path: Path) -> tuple[int, bool]:
        def read(kept: bytes) -> int:
            return int(kept)

        def encode(decided: int) -> bytes:
            return str(decided).encode()

        return kept_decision(path, read, self.measure, encode, "test", watch=self.watch)


def test_a_busy_measurement_serves_the_starts_racing_it_and_a_later_start_measures_again(
    tmp_path: Path,
) -> None:
    path = tmp_path / "decision.json"
    runs = Measurements([BUSY_SHARE * 3, 0.0, 0.0])
    assert runs.decide(path) == (1, False)
    assert path.with_suffix(".busy").exists()
    assert runs.decide(path) == (1, True)  # a start racing it reads it
    busy = path.with_suffix(".busy")
    stale = busy.stat().st_mtime - precision.BUSY_KEPT_S - 1
    os.utime(busy, (stale, stale))
    assert runs.decide(path) == (2, False)  # later: measured again, on a quiet machine
    assert not path.with_suffix(".busy").exists()
    assert runs.decide(path) == (2, True)
    assert runs.count == 2


@pytest.mark.parametrize("share", [None, 0.0, BUSY_SHARE])
def test_a_quiet_or_unknown_measurement_is_kept_for_good(
    tmp_path: Path, share: float | None
) -> None:
    path = tmp_path / "decision.json"
    runs = Measurements([share])
    assert runs.decide(path) == (1, False)
    assert not path.with_suffix(".busy").exists()
    assert runs.decide(path) == (1, True)
    assert runs.count == 1

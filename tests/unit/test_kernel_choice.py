"""Which packed GEMM each projection shape runs: the decision from timings (fake ones
here: which kernel a CPU runs faster is not a test's to pin), Sluice's own taking a
shape only by a margin, a burst during one pass not deciding, torch's wherever Sluice's
is not built, and the outcome kept per machine and reused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.engine import kernel_choice
from sluice.engine.fused_projections import ProjectionMember
from sluice.engine.gguf_blocks import Plane, decode_rows
from sluice.engine.gguf_packed import Int4Projections
from sluice.engine.kernel_choice import (
    MARGIN,
    NAMES,
    PASSES,
    KernelChoice,
    choose_kernels,
    faster,
    time_kernels,
)
from sluice.engine.plane_kernels import OwnPlanes, TorchPlanes
from tests.unit.test_gguf_blocks import own_kernel, random_tensor


def member(out_features: int, seed: int) -> ProjectionMember:
    """A packed projection with no kernel yet, as ``pack_model`` leaves it."""
    weight = decode_rows(random_tensor("Q4_1", out_features, 64, seed), "Q4_1", 64)
    linear = torch.nn.Linear(64, out_features, bias=False)
    return ProjectionMember(Int4Projections([linear], [weight], kernel=None), 0, 64)


def model() -> torch.nn.ModuleList:
    return torch.nn.ModuleList([member(32, 1), member(48, 2), member(32, 3)])


def test_own_takes_a_shape_only_by_the_margin() -> None:
    assert faster({"own": 1.0, "torch": 1.0 * MARGIN * 1.01}) == "own"
    assert faster({"own": 1.0, "torch": 1.0 * MARGIN * 0.99}) == "torch"  # a near-tie
    assert faster({"own": 2.0, "torch": 1.0}) == "torch"


def test_each_shape_is_chosen_kept_and_reused(tmp_path: Path) -> None:
    """Two shapes, two kernels, each measured ``PASSES`` times (once a shape a pass); a
    second model of the same shapes on the same machine measures nothing."""
    own_kernel()
    calls: list[int] = []

    def timer(planes: list[Plane], dtype: torch.dtype) -> dict[str, float]:
        rows = planes[0].codes.shape[0]
        calls.append(rows)
        return {"own": 1.0, "torch": 2.0} if rows == 48 else {"own": 2.0, "torch": 1.0}

    first = model()
    chosen = choose_kernels(first, tmp_path, timer)
    assert chosen == KernelChoice({(32, 64, 1): "torch", (48, 64, 1): "own"}, "measured")
    assert sorted(calls) == [32] * PASSES + [48] * PASSES
    assert [type(m.shared.kernel) for m in first] == [TorchPlanes, OwnPlanes, TorchPlanes]
    assert all(m.shared.planes is None for m in first)  # dropped once a kernel holds them
    assert chosen.to_dict()["shapes"] == [
        {"out": 32, "in": 64, "planes": 1, "kernel": NAMES["torch"]},
        {"out": 48, "in": 64, "planes": 1, "kernel": NAMES["own"]},
    ]
    calls.clear()
    again = model()
    kept = choose_kernels(again, tmp_path, timer)
    assert (kept.reason, kept.kernels, calls) == ("measured earlier", chosen.kernels, [])
    assert [type(m.shared.kernel) for m in again] == [TorchPlanes, OwnPlanes, TorchPlanes]


def test_a_burst_during_one_pass_does_not_decide() -> None:
    own_kernel()
    seen: list[int] = []

    def timer(planes: list[Plane], dtype: torch.dtype) -> dict[str, float]:
        seen.append(1)
        return {"own": 9.0 if len(seen) == 1 else 1.0, "torch": 2.0}

    assert choose_kernels(model(), None, timer).kernels == {(32, 64, 1): "own", (48, 64, 1): "own"}


def test_without_own_kernel_torchs_serves_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_choice, "planes_kernel", lambda: "RuntimeError: no compiler")

    def timer(planes: list[Plane], dtype: torch.dtype) -> dict[str, float]:
        raise AssertionError("nothing to measure")

    served = model()
    chosen = choose_kernels(served, None, timer)
    assert chosen.reason == "own unavailable: RuntimeError: no compiler"
    assert set(chosen.kernels.values()) == {"torch"}
    assert all(isinstance(m.shared.kernel, TorchPlanes) for m in served)


def test_both_kernels_are_timed_over_a_decode_steps_rows() -> None:
    own_kernel()
    weight = decode_rows(random_tensor("Q8_0", 32, 64, 0), "Q8_0", 64)
    times = time_kernels(list(weight.planes), torch.bfloat16)
    assert set(times) == {"own", "torch"} and all(t > 0 for t in times.values())

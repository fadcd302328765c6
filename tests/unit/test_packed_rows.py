"""Up to how many rows a packed projection multiplies packed: the decision from timings
(fake ones here: what a CPU measures is not a test's to pin), its measurement stopping
where dense first wins, each timed product starting from emptied caches, and the
outcome kept per machine and reused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.engine import packed_rows
from sluice.engine.fused_projections import ProjectionMember
from sluice.engine.gguf_blocks import decode_rows
from sluice.engine.gguf_packed import Int4Projections
from sluice.engine.packed_rows import (
    CANDIDATE_ROWS,
    FLUSH_BYTES,
    HEAD_ROWS,
    PASSES,
    REPEATS,
    CacheFlush,
    PackedRows,
    calibrate,
    head_shape,
    largest_packed_rows,
    last_level_cache_bytes,
    measure_limits,
    time_products,
)
from sluice.engine.scheduler import SchedulerConfig
from tests.unit.test_gguf_blocks import random_tensor


def projections(out_features: int, file_type: str = "Q4_1", seed: int = 0) -> Int4Projections:
    weight = decode_rows(random_tensor(file_type, out_features, 64, seed), file_type, 64)
    linear = torch.nn.Linear(64, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(weight.dequantize()))
    return Int4Projections([linear], [weight])


def member(out_features: int, seed: int) -> ProjectionMember:
    """A packed linear as it sits in a model: the member of its shared projection."""
    return ProjectionMember(projections(out_features, seed=seed), 0, 64)


def test_the_limit_is_the_last_count_dense_was_not_clearly_faster_at() -> None:
    assert largest_packed_rows({1: (1, 3), 2: (1, 3), 4: (2, 3), 8: (4, 3)}) == 4
    assert largest_packed_rows({1: (1, 3), 2: (4, 3), 4: (1, 3)}) == 1  # no skipping a loss
    assert largest_packed_rows({1: (4, 3)}) == 0  # dense from one row
    # A near-tie (dense faster by less than the margin) keeps packing.
    assert largest_packed_rows({1: (3, 3), 2: (3.2, 3), 4: (3.25, 3), 8: (3.4, 3)}) == 4
    assert largest_packed_rows({r: (1, 2) for r in CANDIDATE_ROWS}) == CANDIDATE_ROWS[-1]


def test_measuring_stops_where_dense_first_wins_and_a_second_pass_confirms() -> None:
    asked: list[int] = []

    def timer(projection: Int4Projections, rows: int) -> tuple[float, float]:
        asked.append(rows)
        return (rows * 1.0, 6.0)  # packed grows with rows, dense does not

    assert measure_limits({(32, 32, 1): projections(32)}, timer) == {(32, 32, 1): 4}
    assert asked == [1, 2, 4, 8] * PASSES


def test_a_burst_of_other_work_in_one_pass_does_not_decide() -> None:
    """Dense is slower at every count, but the first pass's one-row sample ran while
    something else held the cores: the second pass's faster time is what counts."""
    passes: list[int] = []

    def timer(projection: Int4Projections, rows: int) -> tuple[float, float]:
        if rows == 1:
            passes.append(1)
        disturbed = rows == 1 and len(passes) == 1
        return (9.0 if disturbed else 1.0, 2.0)

    limits = measure_limits({(32, 32, 1): projections(32)}, timer)
    assert limits == {(32, 32, 1): CANDIDATE_ROWS[-1]}


class WithHead(torch.nn.Module):
    """A packed layer and a packed LM head, as a causal LM holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = member(32, 1)
        self.lm_head = member(48, 2)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head


def test_the_lm_head_is_timed_to_its_rows_and_the_layers_through_prompt_chunks(
    tmp_path: Path,
) -> None:
    """Packed wins everywhere: the layers' projection is timed at every count up to a
    prompt chunk with its decoding rows, the head (a step's last positions only) to
    ``HEAD_ROWS``."""
    asked: dict[tuple[int, int, int], list[int]] = {}

    def timer(projection: Int4Projections, rows: int) -> tuple[float, float]:
        asked.setdefault(projection.shape, []).append(rows)
        return (1.0, 2.0)

    model = WithHead()
    assert head_shape(model) == (48, 64, 1)
    assert head_shape(torch.nn.ModuleList([member(48, 2)])) is None
    chosen = calibrate(model, tmp_path, timer)
    assert chosen.limits == {(32, 64, 1): CANDIDATE_ROWS[-1], (48, 64, 1): HEAD_ROWS}
    assert asked[(32, 64, 1)] == list(CANDIDATE_ROWS) * PASSES
    assert asked[(48, 64, 1)] == [r for r in CANDIDATE_ROWS if r <= HEAD_ROWS] * PASSES
    # A step of the default prompt chunk and 64 decoding rows beside it stays packed.
    assert CANDIDATE_ROWS[-1] >= SchedulerConfig.__dataclass_fields__["prefill_chunk"].default + 64


def test_a_decision_is_applied_per_shape_kept_and_reused(tmp_path: Path) -> None:
    """Two shapes, two limits; a second model of the same shapes on the same machine
    reads the kept decision and measures nothing; what it serves follows the limit."""
    calls: list[tuple[tuple[int, int, int], int]] = []

    def timer(projection: Int4Projections, rows: int) -> tuple[float, float]:
        calls.append((projection.shape, rows))
        turn = 2 if projection.shape[0] == 32 else 8  # the wider weight stays packed longer
        return (1.0, 2.0) if rows <= turn else (2.0, 1.0)

    def model() -> torch.nn.ModuleList:
        return torch.nn.ModuleList([member(32, 1), member(48, 2), member(32, 3)])

    first = model()
    chosen = calibrate(first, tmp_path, timer)
    assert chosen.reason == "measured"
    assert chosen.limits == {(32, 64, 1): 2, (48, 64, 1): 8}
    assert [m.shared.max_rows for m in first] == [2, 8, 2]
    assert sorted({shape for shape, _ in calls}) == [(32, 64, 1), (48, 64, 1)]  # once a shape
    calls.clear()
    again = model()
    kept = calibrate(again, tmp_path, timer)
    assert (kept.reason, kept.limits, calls) == ("measured earlier", chosen.limits, [])
    assert [m.shared.max_rows for m in again] == [2, 8, 2]
    # Past its limit a projection multiplies the de-quantised weight, as the linear would.
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(again[0](x), again[0].shared.dense_product(x))
        assert not torch.equal(again[1](x), again[1].shared.dense_product(x))


def test_a_model_without_packed_projections_measures_nothing(tmp_path: Path) -> None:
    assert calibrate(torch.nn.Linear(4, 4), tmp_path) == PackedRows()
    assert list(tmp_path.iterdir()) == []


def test_the_last_level_cache_is_read_as_linux_reports_it(tmp_path: Path) -> None:
    for index, size in enumerate(("48K", "1280K", "32768K", "1M")):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(f"{size}\n")
    assert last_level_cache_bytes(tmp_path) == 32 << 20
    assert last_level_cache_bytes(tmp_path / "none") is None


def test_every_timed_product_starts_from_emptied_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a decode step each weight comes from memory, not from the cache a moment's
    earlier product left it in: the caches are emptied before every product, warm-up
    included, by reading twice the last-level cache."""
    events: list[str] = []
    projection = projections(32)
    monkeypatch.setattr(packed_rows, "last_level_cache_bytes", lambda: 1 << 20)
    monkeypatch.setattr(CacheFlush, "__call__", lambda self: events.append("flush"))
    for name in ("packed_product", "dense_product"):
        monkeypatch.setattr(projection, name, lambda x, name=name: events.append(name))
    packed, dense = time_products(projection, 2)
    assert packed > 0 and dense > 0
    assert events == ["flush", "packed_product", "flush", "dense_product"] * (REPEATS + 1)
    assert CacheFlush().buffer.numel() * 4 == 2 << 20
    monkeypatch.setattr(packed_rows, "last_level_cache_bytes", lambda: None)
    assert CacheFlush().buffer.numel() * 4 == FLUSH_BYTES

"""Bucketing of the fixed-shape decode step (engine/cuda_graphs.py); its outputs are
checked against the plain step in test_engine.py."""

from __future__ import annotations

import pytest

from sluice.engine.cuda_graphs import batch_bucket, read_len_bucket


@pytest.mark.parametrize(
    ("rows", "limit", "bucket"),
    [
        (1, 64, 1),
        (2, 64, 2),
        (3, 64, 4),
        (5, 64, 8),
        (8, 64, 8),
        (9, 64, 16),
        (17, 64, 24),
        (64, 64, 64),
        (3, 3, 3),
        (9, 12, 12),
        (60, 61, 61),
    ],
)
def test_batch_bucket(rows: int, limit: int, bucket: int) -> None:
    assert batch_bucket(rows, limit) == bucket
    assert rows <= bucket <= limit


@pytest.mark.parametrize(
    ("needed", "capacity", "length"),
    [
        (1, 4096, 128),
        (128, 4096, 128),
        (129, 4096, 256),
        (1000, 4096, 1024),
        (1025, 4096, 2048),
        (100, 64, 64),
        (300, 300, 300),
    ],
)
def test_read_len_bucket(needed: int, capacity: int, length: int) -> None:
    assert read_len_bucket(needed, capacity) == length

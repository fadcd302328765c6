"""``argmax_rows`` (engine/kernels/sampling_ops.cpp) gives ``torch.argmax(dim=1)``'s
indices exactly: widths below, at and past the kernel's sixteen lanes with every tail,
ties (the first index wins, across lanes too), a NaN (the first NaN wins, as in torch),
rows of -inf; and the sampler's greedy choice goes through it."""

from __future__ import annotations

import random

import pytest
import torch

from sluice.engine import sampler
from sluice.engine.native_kernels import loaded_op
from sluice.engine.params import SamplingParams
from sluice.engine.sampler import RowState, sample
from tests.unit.test_gguf_blocks import own_kernel

WIDTHS = [1, 2, 15, 16, 17, 31, 32, 33, 100, 49152 + 5]


@pytest.fixture(scope="module")
def argmax_rows() -> object:
    own_kernel()
    op = loaded_op("argmax_rows")
    assert op is not None
    return op


def cases(rows: int, width: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(width)
    spread = torch.randn(rows, width, generator=generator)
    nan_late = spread.clone()
    nan_late[:, width // 2 :] = float("nan")
    nan_first = spread.clone()
    nan_first[:, 0] = float("nan")
    few = torch.randint(0, 3, (rows, width), generator=generator).float()
    return {
        "spread": spread,
        "few values (ties across lanes)": few,
        "all equal": torch.zeros(rows, width),
        "all -inf": torch.full((rows, width), float("-inf")),
        "NaN from the middle": nan_late,
        "NaN first": nan_first,
    }


@pytest.mark.parametrize("width", WIDTHS)
def test_argmax_rows_is_torchs_argmax(argmax_rows: object, width: int) -> None:
    for name, logits in cases(3, width).items():
        got = argmax_rows(logits)  # type: ignore[operator]
        assert got.dtype == torch.long, name
        assert torch.equal(got, logits.argmax(dim=1)), name


def test_the_maximum_in_the_tail_and_repeated_in_every_lane(argmax_rows: object) -> None:
    logits = torch.zeros(4, 53)
    logits[0, 52] = 1  # only in the scalar tail
    logits[1, [5, 21, 37, 52]] = 1  # lane 5 three times, then the tail: 5 wins
    logits[2, [40, 24]] = 1  # two lanes: the smaller index wins
    logits[3, 0] = -1  # the maximum (0) first seen at index 1
    assert argmax_rows(logits).tolist() == [52, 5, 24, 1]  # type: ignore[operator]


def test_greedy_sampling_takes_the_kernels_choice(
    argmax_rows: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[torch.Tensor] = []

    def spy(name: str) -> object:
        def op(logits: torch.Tensor) -> torch.Tensor:
            calls.append(logits)
            return argmax_rows(logits)  # type: ignore[operator,no-any-return]

        return op if name == "argmax_rows" else None

    monkeypatch.setattr(sampler, "loaded_op", spy)
    logits = torch.randn(5, 49152, generator=torch.Generator().manual_seed(7))
    rows = [RowState(SamplingParams(temperature=0.0), random.Random(0), (1,)) for _ in range(5)]
    assert sample(logits, rows).tokens == logits.argmax(dim=1).tolist()
    assert len(calls) == 1 and calls[0] is logits
    # Logits that are not contiguous float32 take torch's argmax.
    assert sample(logits.T.contiguous().T, rows).tokens == logits.argmax(dim=1).tolist()
    assert len(calls) == 1

"""``argmax_rows`` (engine/kernels/sampling_ops.cpp) gives ``torch.argmax(dim=1)``'s
indices exactly, of float32 and of bfloat16 logits: widths below, at and past the
kernel's sixteen lanes with every tail, ties (the first index wins, across lanes too),
a NaN (the first NaN wins, as in torch), rows of -inf; and the sampler's greedy choice
goes through it, bfloat16 logits as they are."""

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", WIDTHS)
def test_argmax_rows_is_torchs_argmax(argmax_rows: object, width: int, dtype: torch.dtype) -> None:
    for name, values in cases(3, width).items():
        logits = values.to(dtype)
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
    # A bfloat16 head's logits as they are: no float32 copy for a greedy row.
    rounded = logits.bfloat16()
    assert sample(rounded, rows).tokens == rounded.float().argmax(dim=1).tolist()
    assert len(calls) == 2 and calls[1] is rounded
    # Logits that are not contiguous take torch's argmax.
    assert sample(logits.T.contiguous().T, rows).tokens == logits.argmax(dim=1).tolist()
    assert len(calls) == 2


def test_bfloat16_logits_sample_as_their_float32_widening() -> None:
    """Every path of the sampler (penalties, a bias, a sampled row, logprobs) gives
    bfloat16 logits the tokens and logprobs of the same logits widened to float32."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3)).bfloat16()
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.0, frequency_penalty=1.5, logit_bias=((7, 5.0),)),
        SamplingParams(temperature=0.8, top_p=0.9, logprobs=0),
        SamplingParams(temperature=1.2),
    ]

    def rows() -> list[RowState]:
        return [
            RowState(p, random.Random(i), (1,), generated=[5, 5, 9]) for i, p in enumerate(params)
        ]

    as_is, widened = sample(logits, rows()), sample(logits.float(), rows())
    assert as_is == widened
    assert as_is.logprobs[0] is not None and as_is.logprobs[2] is not None

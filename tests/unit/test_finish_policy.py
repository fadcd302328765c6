"""The finish policy (engine/finish.py): why a sequence ends after one sampled token."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.engine.finish import Finish, GrammarVerdict, finish_after
from sluice.engine.params import SamplingParams

EOS = 2
GOING = GrammarVerdict(accepted=True, stopped=False)


def decide(
    token: int, generated: int, grammar: GrammarVerdict | None = None, **params: Any
) -> Finish | None:
    return finish_after(
        token,
        generated=generated,
        params=SamplingParams(**{"max_tokens": 10, **params}),
        stop_ids=frozenset({EOS, 7}),
        prompt_len=5,
        context_length=20,
        grammar=grammar,
    )


@pytest.mark.parametrize(
    ("token", "generated", "grammar", "params", "expected"),
    [
        pytest.param(3, 1, None, {}, None, id="goes-on"),
        pytest.param(EOS, 1, None, {}, Finish("stop", EOS), id="eos"),
        pytest.param(7, 1, None, {}, Finish("stop", 7), id="stop-token-id"),
        pytest.param(EOS, 2, None, {"min_tokens": 3}, None, id="eos-before-min-tokens"),
        pytest.param(EOS, 3, None, {"min_tokens": 3}, Finish("stop", EOS), id="eos-at-min-tokens"),
        # The mask lets a stop id through only where the grammar may end.
        pytest.param(EOS, 1, GOING, {"min_tokens": 3}, Finish("stop", EOS), id="eos-constrained"),
        pytest.param(
            3,
            1,
            GrammarVerdict(accepted=False, stopped=False, error="no"),
            {},
            Finish("abort", error="the grammar rejected token 3: no"),
            id="rejected",
        ),
        pytest.param(3, 1, GrammarVerdict(True, True), {}, Finish("stop"), id="grammar-complete"),
        pytest.param(3, 9, GOING, {}, None, id="constrained-goes-on"),
        pytest.param(3, 10, None, {}, Finish("length"), id="max-tokens"),
        pytest.param(3, 15, None, {"max_tokens": 100}, Finish("length"), id="context-full"),
        pytest.param(EOS, 10, None, {}, Finish("stop", EOS), id="stop-wins-over-length"),
    ],
)
def test_finish_after(
    token: int,
    generated: int,
    grammar: GrammarVerdict | None,
    params: dict[str, Any],
    expected: Finish | None,
) -> None:
    assert decide(token, generated, grammar, **params) == expected

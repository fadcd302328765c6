"""Every fp32 greedy text an end-to-end test pins is ``model.generate``'s on this
machine, and no step of it is near a tie (``tests/support/greedy_pins.py``): so the
pins hold on any x86 CPU, whichever kernels it runs. The engine's own equality with
``model.generate`` is ``test_engine.py``'s."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.greedy import greedy_run
from tests.support.greedy_pins import PIN_MARGIN, PINS, GreedyPin

pytestmark = pytest.mark.model


def input_ids(tokenizer: Any, pin: GreedyPin) -> list[int]:
    if pin.prompt is not None:
        return list(tokenizer(pin.prompt).input_ids)
    ids = tokenizer.apply_chat_template(
        [dict(m) for m in pin.messages],
        tokenize=True,
        return_dict=False,
        add_generation_prompt=not pin.continue_final_message,
        continue_final_message=pin.continue_final_message,
    )
    return list(ids)


@pytest.mark.parametrize("name", sorted(PINS))
def test_a_pinned_text_is_greedy_here_and_far_from_a_tie(
    name: str, loaded: tuple[Any, Any]
) -> None:
    tokenizer, model = loaded
    pin = PINS[name]
    run = greedy_run(model, input_ids(tokenizer, pin), pin.max_tokens)
    tokens = run.tokens
    assert tokenizer.decode(tokens, skip_special_tokens=True) == pin.text
    assert (tokens[-1] == tokenizer.eos_token_id) is pin.eos
    assert len(tokens) < pin.max_tokens if pin.eos else len(tokens) == pin.max_tokens
    margins = run.margins()
    assert min(margins) >= PIN_MARGIN, [round(m, 4) for m in margins]

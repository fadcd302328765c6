"""The default model's fp32 greedy texts that end-to-end tests pin, each with the input
that gives it. One place, so that ``tests/engine/test_greedy_pins.py`` can check every
one against ``model.generate`` on the machine running the suite, and check that at
every step the chosen token leads the runner-up by ``PIN_MARGIN``: far more than fp32
accumulation order moves a logit from one CPU's kernels to another's. A text that
depends on a CPU's rounding (int8, bf16) is never pinned: it is compared with a
reference computed in the same test."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.support.e2e_chat import Message, user

# Logits, between the greedy choice and the runner-up, at every step of a pinned text.
# fp32 results from two CPUs' kernels (AVX-512 against AVX2, oneDNN against MKL) differ
# by ~1e-4 here; a pin closer to a tie than this is a coin toss on another machine.
PIN_MARGIN = 0.05


@dataclass(frozen=True)
class GreedyPin:
    """``text`` is what greedy decoding gives for ``messages`` (chat, rendered with the
    model's template) or ``prompt`` (completions) within ``max_tokens``; ``eos`` says
    whether it ends by choosing EOS there (else the cut ends it)."""

    text: str
    max_tokens: int
    eos: bool
    prompt: str | None = None
    messages: tuple[Message, ...] = field(default=())
    continue_final_message: bool = False


FRANCE_QUESTION = "What is the capital of France?"
FRANCE = user(FRANCE_QUESTION)
FRANCE_ANSWER = "The capital of France is Paris."  # 7 tokens, then EOS
ITALY = "And of Italy?"
ITALY_FOLLOW_UP = "The capital of Italy is Rome."  # after FRANCE_ANSWER, then EOS
TWO = user("What is 2+2?")
TWO_ANSWER = "The answer to this classic math problem is 4."  # 11 tokens, then EOS
HAIKU_QUESTION = "Write a haiku about the sea."
HAIKU = user(HAIKU_QUESTION)
HAIKU_24 = (  # cut by a 24-token limit (HAIKU_16 by a 16-token one)
    "The waves of the sea, a silent beauty,\nA gentle lapping of the shore,\nA reminder of the"
)
HAIKU_16 = "The waves of the sea, a silent beauty,\nA gentle lapping of"
PIRATE_SYSTEM = "You are a pirate. Answer briefly."
PIRATE: list[Message] = [
    {"role": "system", "content": PIRATE_SYSTEM},
    {"role": "user", "content": FRANCE_QUESTION},
    {"role": "assistant", "content": "Arr, it be Paris!"},
    {"role": "user", "content": ITALY},
]
PIRATE_ANSWER = "Bien sûr, it be Rome!"  # 10 tokens, then EOS
FRANCE_PREFIX = "The capital of France is"  # an assistant turn continued (continue_final_message)
PARIS = "The capital of France is"  # completions: 5 tokens [504, 3575, 282, 4649, 314]
PARIS_8 = " Paris.\n\nThe answer is:"  # max_tokens=8
ONCE = "Once upon a time"  # 4 tokens
ONCE_4 = ", the city of"  # max_tokens=4
QUESTION = "What is 2+2? Answer:"  # 9 tokens; greedy chooses EOS first

PINS: dict[str, GreedyPin] = {
    "france": GreedyPin(FRANCE_ANSWER, 24, True, messages=tuple(FRANCE)),
    "italy": GreedyPin(
        ITALY_FOLLOW_UP,
        24,
        True,
        messages=(*FRANCE, {"role": "assistant", "content": FRANCE_ANSWER}, *user(ITALY)),
    ),
    "two": GreedyPin(TWO_ANSWER, 24, True, messages=tuple(TWO)),
    "haiku": GreedyPin(HAIKU_24, 24, False, messages=tuple(HAIKU)),
    "pirate": GreedyPin(PIRATE_ANSWER, 24, True, messages=tuple(PIRATE)),
    "continued": GreedyPin(
        " Paris.",
        24,
        True,
        messages=(*FRANCE, {"role": "assistant", "content": FRANCE_PREFIX}),
        continue_final_message=True,
    ),
    "paris": GreedyPin(PARIS_8, 8, False, prompt=PARIS),
    "once": GreedyPin(ONCE_4, 4, False, prompt=ONCE),
    "question": GreedyPin("", 4, True, prompt=QUESTION),
}

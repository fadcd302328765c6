"""Micro-benchmarks of the detokenize stage's text machinery.

Run with ``pytest bench/micro --benchmark-enable``; plain ``pytest`` does not collect them.
"""

from __future__ import annotations

from typing import Any

from sluice.pipeline.detokenizer import IncrementalDetokenizer
from sluice.pipeline.stop_matcher import StopMatcher

SAMPLE = (
    "The quick brown fox jumps over the lazy dog. 日本語のテキスト 🦜🪿 café naïve.\n"
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n"
)


def test_detokenizer_push_256_tokens(benchmark: Any, tokenizer: Any) -> None:
    ids = tokenizer.encode(SAMPLE * 20, add_special_tokens=False)[:256]
    assert len(ids) == 256

    def run() -> str:
        detok = IncrementalDetokenizer(tokenizer)
        return "".join([detok.push(i) for i in ids]) + detok.flush()

    assert benchmark(run) == tokenizer.decode(ids)


def test_stop_matcher_feed_256_chunks(benchmark: Any) -> None:
    text = SAMPLE * 20
    chunks = [text[i : i + 4] for i in range(0, 4 * 256, 4)]
    stops = ["<|im_end|>", "\n\nUser:", "STOP", "###"]

    def run() -> str:
        matcher = StopMatcher(stops)
        return "".join([matcher.feed(c).text for c in chunks]) + matcher.flush()

    assert benchmark(run) == "".join(chunks)


def test_stop_matcher_no_stops_256_chunks(benchmark: Any) -> None:
    chunks = [SAMPLE[i % len(SAMPLE) :][:4] for i in range(256)]

    def run() -> int:
        matcher = StopMatcher(())
        return sum(len(matcher.feed(c).text) for c in chunks)

    assert benchmark(run) == sum(map(len, chunks))

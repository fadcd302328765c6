"""Micro-benchmarks of the per-token hot paths outside the model: event
serialisation (recording), completions chunk projection and SSE encoding.

Run with ``make bench`` (``pytest bench/micro --benchmark-enable``); never a gate.
"""

from __future__ import annotations

from typing import Any

from sluice.events.codec import decode_event, encode_event
from sluice.events.types import Delta, TextLogprob, TokenLogprob, TokenSampled
from sluice.http.projections.completions import CompletionStream
from sluice.http.sse import data_frames

TOKEN = TokenSampled(
    "cmpl-0123456789abcdef", 3, 17, 4312, TokenLogprob(4312, -0.25, ((4312, -0.25),))
)
DELTA = Delta("cmpl-0123456789abcdef", 3, 18, " Paris", 1)
DELTA_LP = Delta(
    "cmpl-0123456789abcdef", 0, 18, " Paris", 1,
    (TextLogprob(" Paris", -0.25, (32, 80, 97, 114, 105, 115), ((" Paris", -0.25, (32,)),)),),
    token_offsets=(0,),
)  # fmt: skip


def test_encode_token_event(benchmark: Any) -> None:
    benchmark(encode_event, TOKEN)


def test_decode_token_event(benchmark: Any) -> None:
    raw = encode_event(TOKEN)
    benchmark(decode_event, raw)


def test_project_and_encode_one_step_of_64_streams(benchmark: Any) -> None:
    """One engine step for 64 streams: 64 chunks projected and framed as SSE."""
    streams = [CompletionStream(f"cmpl-{i}", 1, "m", want_logprobs=False) for i in range(64)]

    def step() -> int:
        total = 0
        for s in streams:
            total += len(data_frames(s.project([DELTA])))
        return total

    assert benchmark(step) > 0


def test_project_chunk_with_logprobs(benchmark: Any) -> None:
    stream = CompletionStream("cmpl-x", 1, "m", want_logprobs=True)
    benchmark(lambda: data_frames(stream.project([DELTA_LP])))

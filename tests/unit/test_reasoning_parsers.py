"""Reasoning parsers: the same reasoning and content however the text is chunked."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from sluice.pipeline.reasoning import (
    REASONING_FORMATS,
    Piece,
    ReasoningParser,
    make_reasoning_parser,
)
from tests.support.chunking import splits


def run(parser: ReasoningParser, chunks: Sequence[str]) -> tuple[str, str]:
    pieces: list[Piece] = []
    for chunk in chunks:
        pieces += parser.feed(chunk)
    pieces += parser.finish()
    assert all(text for _, text in pieces)
    return (
        "".join(t for channel, t in pieces if channel == "reasoning"),
        "".join(t for channel, t in pieces if channel == "content"),
    )


CASES: list[tuple[str, str, str, str]] = [
    (
        "deepseek-r1",
        "Let me think.\n</think>\n\nThe answer is 4.",
        "Let me think.",
        "The answer is 4.",
    ),
    ("deepseek-r1", "<think>\nLet me think.\n</think>The answer", "Let me think.", "The answer"),
    ("deepseek-r1", "Still thinking about </thi", "Still thinking about </thi", ""),
    ("deepseek-r1", "thinking… <think>\n\n", "thinking… <think>", ""),
    (
        "qwen3",
        "<think>\nHmm 🤔 <b>x</b> </thin k> <think>\n</think>\n\nAnswer: 東京 </think>",
        "Hmm 🤔 <b>x</b> </thin k> <think>",
        "Answer: 東京 </think>",
    ),
    ("qwen3", "Just an answer with </think> in it.\n", "", "Just an answer with </think> in it.\n"),
    ("qwen3", "\n\n<think>a</think>b", "a", "b"),
    ("qwen3", "Intro <think>a</think> b", "a", "Intro b"),
    ("qwen3", "<think>\n\n</think>\n\nHello", "", "Hello"),
    ("qwen3", "<think>unfinished [", "unfinished [", ""),
    ("qwen3", "  \n", "", "  \n"),
    ("kimi", "◁think▷深思 ◁think ▷◁/think▷答案", "深思 ◁think ▷", "答案"),
    ("mistral", "[THINK]Plan: [a] then [b][/THINK]Result [1]", "Plan: [a] then [b]", "Result [1]"),
    ("mistral", "No thinking [/THINK] here", "", "No thinking [/THINK] here"),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
@pytest.mark.parametrize("stream_reasoning", [True, False])
def test_every_chunking_gives_the_same_split(
    name: str, text: str, reasoning: str, content: str, stream_reasoning: bool
) -> None:
    for chunks in splits(text):
        parser = make_reasoning_parser(name, stream_reasoning=stream_reasoning)
        assert run(parser, chunks) == (reasoning, content), chunks


@pytest.mark.parametrize("name", sorted(REASONING_FORMATS))
def test_markers_never_leak_and_text_is_released_early(name: str) -> None:
    fmt = REASONING_FORMATS[name]
    parser = make_reasoning_parser(name)
    assert parser.feed(fmt.start + "step one") == [("reasoning", "step one")]
    for char in fmt.end[:-1]:
        assert parser.feed(char) == []  # could be the end marker: held
    assert parser.feed(fmt.end[-1] + "answer") == [("content", "answer")]
    assert parser.finish() == []


@pytest.mark.parametrize("name", sorted(REASONING_FORMATS))
def test_random_fragments_chunk_alike(name: str) -> None:
    fmt = REASONING_FORMATS[name]
    atoms = (fmt.start, fmt.end, fmt.start[:2], fmt.end[:3], "<tool_call>", "x", " ", "\n")
    rng = random.Random(name)
    for _ in range(200):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 10)))
        whole = run(make_reasoning_parser(name), [text])
        assert run(make_reasoning_parser(name), list(text)) == whole, text
        held = make_reasoning_parser(name, stream_reasoning=False)
        assert run(held, list(text)) == whole, text


def test_held_reasoning_comes_in_one_piece_at_the_end_marker() -> None:
    parser = make_reasoning_parser("qwen3", stream_reasoning=False)
    out = [parser.feed(c) for c in "<think>a b c</think>answer"]
    assert out[-len("answer") - 1] == [("reasoning", "a b c")]  # the ">" of </think>
    assert [p for pieces in out for p in pieces if p[0] == "reasoning"] == [("reasoning", "a b c")]
    truncated = make_reasoning_parser("qwen3", stream_reasoning=False)
    assert truncated.feed("<think>cut off ") == []
    assert truncated.finish() == [("reasoning", "cut off")]


def test_options() -> None:
    off = make_reasoning_parser("qwen3", enable_thinking=False)
    assert run(off, ["<think>x</think>y"]) == ("", "<think>x</think>y")
    forced = make_reasoning_parser("qwen3", force_reasoning=True)
    assert run(forced, ["x</think>y"]) == ("x", "y")
    unforced = make_reasoning_parser("deepseek-r1", force_reasoning=False)
    assert run(unforced, ["x</think>y"]) == ("", "x</think>y")


def test_qwen3_tool_call_ends_an_unclosed_block() -> None:
    parser = make_reasoning_parser("qwen3")
    assert run(parser, ['<think>plan\n<tool_call>{"name": "f"}</tool_call>']) == (
        "plan",
        '<tool_call>{"name": "f"}</tool_call>',
    )


def test_unknown_parser_lists_the_names() -> None:
    with pytest.raises(ValueError, match="choose one of: deepseek-r1, kimi, mistral, qwen3"):
        make_reasoning_parser("nope")

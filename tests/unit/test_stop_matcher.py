"""StopMatcher: the same release and match however the text is chunked."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import pytest

from sluice.pipeline.stop_matcher import StopMatcher, StopResult


def _expected(text: str, stops: Sequence[str], no_stop_trim: bool) -> tuple[str, str | None]:
    """Brute force over every occurrence: the earliest start wins, then the longest."""
    hits = [
        (i, -len(stop), stop)
        for stop in stops
        if stop
        for i in range(len(text))
        if text.startswith(stop, i)
    ]
    if not hits:
        return text, None
    pos, _, stop = min(hits)
    return text[: pos + len(stop)] if no_stop_trim else text[:pos], stop


def _splits(text: str) -> Iterator[list[str]]:
    """One chunk, two chunks at every split, three at every pair, one char at a time."""
    n = len(text)
    yield [text]
    for i in range(n + 1):
        yield [text[:i], text[i:]]
    for i in range(n + 1):
        for j in range(i, n + 1):
            yield [text[:i], text[i:j], text[j:]]
    yield list(text)


def _run(chunks: Sequence[str], stops: Sequence[str], no_stop_trim: bool) -> tuple[str, str | None]:
    matcher = StopMatcher(stops, no_stop_trim=no_stop_trim)
    released, matched = "", None
    for chunk in chunks:
        result = matcher.feed(chunk)
        if matched is not None:
            assert result == StopResult("", None)  # nothing after a match
            continue
        released += result.text
        matched = result.matched
        if not no_stop_trim:
            # Released text never contains a stop, not even one that is still completing.
            assert not any(stop in released for stop in stops if stop)
    if matched is None:
        released += matcher.flush()
        matched = matcher.matched
    else:
        assert matcher.flush() == ""
    assert matcher.matched == matched
    return released, matched


CASES: list[tuple[tuple[str, ...], str]] = [
    # overlapping stops
    (("ab", "b"), "xxabyy"),
    (("ab", "b"), "xxbab"),
    (("ab", "b"), "aab"),
    # stops that are prefixes of each other
    (("ab", "abc"), "zabcz"),
    (("ab", "abc"), "zabz"),
    (("ab", "abc"), "zab"),
    (("abc", "ab"), "zaabcab"),
    (("\n", "\n\n"), "one\n\ntwo"),
    (("\n", "\n\n"), "one\ntwo\n\n"),
    # one stop inside another
    (("bc", "abcd"), "xabcd"),
    (("bc", "abcd"), "xabce"),
    (("bc", "abcd"), "xabc"),
    # self-overlapping stops
    (("aa", "aaa"), "baaaab"),
    (("aab",), "aaaab"),
    (("abab",), "abababx"),
    (("abcabd",), "abcabcabdx"),
    # unicode
    (("日本", "🦜"), "こんにちは日本の🦜"),
    (("🦜",), "a🦜b🦜"),
    (("é", "e\u0301"), "cafe\u0301 café"),
    (("</s>", "<|im_end|>"), "answer: 42<|im_end|>\n"),
    # at the very start / very end / not at all
    (("###",), "###rest"),
    (("stop",), "no match here, only st"),
    (("stop",), "ends with the stop"),
    (("world",), "hello wor"),
    (("x", "y"), ""),
    # no stops, and stops that are empty or repeated
    ((), "nothing to stop here"),
    (("", "b", "b"), "abc"),
]


@pytest.mark.parametrize("no_stop_trim", [False, True])
@pytest.mark.parametrize(("stops", "text"), CASES)
def test_every_chunking_gives_the_same_result(
    stops: tuple[str, ...], text: str, no_stop_trim: bool
) -> None:
    expected = _expected(text, stops, no_stop_trim)
    for chunks in _splits(text):
        assert _run(chunks, stops, no_stop_trim) == expected, chunks


def test_expected_outcomes() -> None:
    # Pin the reference itself, so the chunking test cannot agree with a wrong oracle.
    assert _expected("xxabyy", ("ab", "b"), False) == ("xx", "ab")
    assert _expected("zabcz", ("ab", "abc"), False) == ("z", "abc")
    assert _expected("zabz", ("ab", "abc"), True) == ("zab", "ab")
    assert _expected("xabcd", ("bc", "abcd"), False) == ("x", "abcd")
    assert _expected("xabce", ("bc", "abcd"), False) == ("xa", "bc")
    assert _expected("###rest", ("###",), False) == ("", "###")
    assert _expected("abc", (), False) == ("abc", None)


def test_holds_back_only_a_possible_stop_prefix() -> None:
    matcher = StopMatcher(["stop", "<|im_end|>"])
    assert matcher.feed("hello st") == StopResult("hello ", None)
    assert matcher.feed("a") == StopResult("sta", None)
    assert matcher.feed("y <|im") == StopResult("y ", None)
    assert matcher.feed("_end|> more") == StopResult("", "<|im_end|>")
    assert matcher.feed("ignored") == StopResult("", None)
    assert matcher.flush() == ""
    assert matcher.matched == "<|im_end|>"


def test_flush_releases_the_held_prefix() -> None:
    matcher = StopMatcher(["world"])
    assert matcher.feed("hello wor") == StopResult("hello ", None)
    assert matcher.flush() == "wor"
    assert matcher.matched is None
    assert matcher.feed("ld") == StopResult("", None)  # finished


def test_a_complete_match_waits_for_a_longer_one() -> None:
    matcher = StopMatcher(["\n", "\n\n"])
    assert matcher.feed("one\n") == StopResult("one", None)
    assert matcher.feed("\n") == StopResult("", "\n\n")
    matcher = StopMatcher(["\n", "\n\n"], no_stop_trim=True)
    assert matcher.feed("one\n") == StopResult("one", None)
    assert matcher.feed("two") == StopResult("\n", "\n")


def test_held_match_is_reported_by_flush() -> None:
    matcher = StopMatcher(["ab", "abc"])
    assert matcher.feed("xab") == StopResult("x", None)
    assert matcher.matched is None
    assert matcher.flush() == ""
    assert matcher.matched == "ab"


def test_stop_inside_one_chunk() -> None:
    result = StopMatcher(["END"]).feed("text END more END")
    assert result == StopResult("text ", "END")
    result = StopMatcher(["END"], no_stop_trim=True).feed("text END more")
    assert result == StopResult("text END", "END")


def test_no_stops_is_a_pass_through() -> None:
    matcher = StopMatcher([])
    assert not matcher.holds_back
    assert StopMatcher(["", ""]).holds_back is False
    assert StopMatcher(["x"]).holds_back is True
    chunk = "any text, even with stop words"
    assert matcher.feed(chunk).text is chunk
    assert matcher.feed(chunk).matched is None
    assert matcher.flush() == ""


def test_result_is_frozen() -> None:
    result = StopResult("a", "b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.text = "c"  # type: ignore[misc]

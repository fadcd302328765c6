"""The n-gram drafter: which earlier occurrence it copies from, and how long a draft it
proposes."""

from __future__ import annotations

import pytest

from sluice.engine.speculative import NgramDrafter, SpeculativeConfig


def drafter(prompt: list[int], **sizes: int) -> NgramDrafter:
    return NgramDrafter(SpeculativeConfig(**sizes), prompt)


def test_copies_what_followed_the_earlier_occurrence() -> None:
    d = drafter([5, 6, 7, 8, 9, 1, 5, 6], num_draft_tokens=3)
    assert d.propose(10) == [7, 8, 9]
    assert d.propose(2) == [7, 8]  # the caller's room: max_tokens, the context
    assert d.propose(0) == []


def test_the_longest_match_wins_then_the_most_recent() -> None:
    # ``3`` occurs three times before the end; the first is preceded by ``2``, as the
    # end is, so its match is two tokens long against one for the others.
    prompt = [2, 3, 40, 41, 9, 3, 50, 51, 8, 3, 60, 61, 2, 3]
    assert drafter(prompt, num_draft_tokens=2).propose(5) == [40, 41]
    # With no longer match, the most recent occurrence.
    assert drafter([1, 3, 40, 7, 3, 50, 8, 3], num_draft_tokens=1).propose(5) == [50]


def test_the_match_window_bounds_how_far_back_matches_are_compared() -> None:
    # Both earlier ``7 8`` grams match the end; the older one matches four tokens back,
    # the newer two. With max_window 2 they tie, and the newer one is copied.
    prompt = [1, 2, 7, 8, 100, 3, 7, 8, 200, 1, 2, 7, 8]
    assert drafter(prompt, min_window=2, max_window=4, num_draft_tokens=1).propose(5) == [100]
    assert drafter(prompt, min_window=2, max_window=2, num_draft_tokens=1).propose(5) == [200]


def test_no_draft_without_an_earlier_min_window_match() -> None:
    assert drafter([1, 2, 3, 4]).propose(8) == []
    assert drafter([1, 2, 9, 2], min_window=2).propose(8) == []  # ``9 2`` is new
    assert drafter([]).propose(8) == []
    # The sequence's own end is never its match: only grams with a follower count.
    assert drafter([4, 4]).propose(8) == [4]


def test_generated_tokens_are_taken_in_as_they_come() -> None:
    d = drafter([10, 11, 12, 13], num_draft_tokens=2)
    generated: list[int] = []
    assert d.propose(4) == []
    generated += [99, 10]
    d.sync(generated)
    assert d.propose(4) == [11, 12]
    generated += [11]
    d.sync(generated)
    d.sync(generated)  # nothing new: nothing indexed twice
    assert d.tokens == [10, 11, 12, 13, 99, 10, 11]
    assert d.propose(4) == [12, 13]


def test_the_draft_length_follows_how_the_last_draft_fared() -> None:
    d = drafter([*range(20), 0, 1], num_draft_tokens=8)
    assert len(d.propose(50)) == 8
    d.settle(8, 2)  # cut short after two kept: the next is three long
    assert d.propose(50) == [2, 3, 4]
    d.settle(3, 3)  # kept whole: doubled
    assert len(d.propose(50)) == 6
    d.settle(6, 6)
    assert len(d.propose(50)) == 8  # no longer than num_draft_tokens
    d.settle(8, 0)
    assert len(d.propose(50)) == 1
    d.settle(0, 0)  # no draft: nothing learnt
    assert len(d.propose(50)) == 1


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"num_draft_tokens": 0}, "--speculative-num-draft-tokens"),
        ({"min_window": 0}, "min-match-window"),
        ({"min_window": 5, "max_window": 4}, "max-match-window"),
    ],
)
def test_sizes_out_of_range_are_refused(sizes: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**sizes)

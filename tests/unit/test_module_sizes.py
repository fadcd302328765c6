"""``python -m sluice.module_sizes``: no source module is over 500 lines, and the check
names the ones that would be over a lower limit (so it can fail)."""

from __future__ import annotations

from sluice.module_sizes import LIMIT, main, oversized


def test_no_source_module_is_over_the_limit() -> None:
    assert oversized() == {}
    assert main() == 0


def test_a_lower_limit_names_the_longest_modules() -> None:
    over = oversized(limit=LIMIT // 2)
    assert over and all(lines > LIMIT // 2 for lines in over.values())
    assert "sluice.engine.scheduler" in over

"""No first-party source module is over ``LIMIT`` lines: ``python -m sluice.module_sizes``
(``make lint`` runs it) prints each one that is and exits 1. A module that long holds
more than one responsibility; split it where its parts stop sharing state.
"""

from __future__ import annotations

import sys

from sluice.import_cycles import REPO, modules

LIMIT = 500


def oversized(limit: int = LIMIT) -> dict[str, int]:
    """Module name → its line count, for each over ``limit``."""
    counts = {
        name: len(path.read_text(encoding="utf-8").splitlines())
        for name, path in modules(REPO).items()
    }
    return {name: n for name, n in sorted(counts.items()) if n > limit}


def main() -> int:
    over = oversized()
    for name, lines in over.items():
        print(f"{name}: {lines} lines (limit {LIMIT})")
    print(f"{len(modules(REPO))} modules, {len(over)} over {LIMIT} lines")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())

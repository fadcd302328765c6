"""Every way to chunk a text (each split position, char by char, byte by byte, random
pieces), for parsers that must not care where chunks break."""

from __future__ import annotations

import codecs
import random
from collections.abc import Iterator


def splits(text: str, seed: int = 0) -> Iterator[list[str]]:
    """Whole, two chunks at every split, one char, one byte at a time, random pieces."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    decoder = codecs.getincrementaldecoder("utf-8")()
    yield [decoder.decode(bytes([b])) for b in text.encode()]
    rng = random.Random(seed)
    for _ in range(8):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
        yield [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]

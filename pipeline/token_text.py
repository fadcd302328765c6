"""Per-token display text and bytes, as OpenAI's ``logprobs`` report them.

A token need not be valid UTF-8 on its own (byte-level BPE splits rare characters into
byte tokens), so ``tokenizer.decode([id])`` would show U+FFFD and lose the bytes. We map
the token back to its raw bytes instead and, like OpenAI, show an incomplete sequence as
``bytes:\\xe2\\x80`` while ``bytes`` carries the real values.
"""

from __future__ import annotations

import builtins
import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# SentencePiece byte-fallback tokens spell one raw byte as "<0xE2>".
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_byte_decoder() -> dict[str, int]:
    """Invert GPT-2's byte-to-printable-char table used by every byte-level BPE vocab."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


BYTE_DECODER = _gpt2_byte_decoder()


class TokenTexts:
    """Cached ``text``/``bytes`` of each token id of one tokenizer."""

    __slots__ = ("_added", "_byte_fallback", "_byte_level", "_cache", "_tokenizer")

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        decoder_types = _decoder_types(tokenizer)
        self._byte_level = "ByteLevel" in decoder_types
        self._byte_fallback = "ByteFallback" in decoder_types
        # Added tokens are stored verbatim, not in the byte-level alphabet.
        self._added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._cache: dict[int, tuple[str, tuple[int, ...]]] = {}

    def text(self, token_id: int) -> str:
        """The token as OpenAI's ``token`` field shows it."""
        return self._entry(token_id)[0]

    def bytes(self, token_id: int) -> tuple[int, ...]:
        """The token's raw UTF-8 bytes, OpenAI's ``bytes`` field."""
        return self._entry(token_id)[1]

    def _entry(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        entry = self._cache.get(token_id)
        if entry is None:
            entry = self._cache[token_id] = self._compute(token_id)
        return entry

    def _compute(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        added = self._added.get(token_id)
        if added is not None:
            return added, tuple(added.encode())
        raw = self._raw_bytes(token_id)
        if raw is None:
            text = str(self._tokenizer.decode([token_id]))
            return text, tuple(text.encode())
        try:
            return raw.decode(), tuple(raw)
        except UnicodeDecodeError:
            return "bytes:" + _escape(raw), tuple(raw)

    def _raw_bytes(self, token_id: int) -> builtins.bytes | None:
        """The token's bytes where the vocabulary spells them out, else None."""
        token = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(token, str):  # an id outside the vocabulary
            return None
        if self._byte_level:
            try:
                return bytes(BYTE_DECODER[c] for c in token)
            except KeyError:  # not a byte-level spelling after all
                return None
        if self._byte_fallback and (match := _BYTE_TOKEN.fullmatch(token)):
            return bytes((int(match[1], 16),))
        return None


def _escape(raw: bytes) -> str:
    """Printable ASCII as is, every other byte as ``\\xNN`` (Python's bytes repr style)."""
    return "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in raw)


def _decoder_types(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    """Type names of the fast tokenizer's decoder, nested ``Sequence`` steps included."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return set()
    found: set[str] = set()

    def walk(node: Any) -> None:
        found.add(node.get("type", ""))
        for child in node.get("decoders", ()):
            walk(child)

    walk(json.loads(decoder.__getstate__()))
    return found

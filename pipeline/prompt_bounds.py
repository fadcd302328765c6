"""How long a text can be and still fit the context: a bound read off the vocabulary.

No token stands for more input than the longest entry of the vocabulary, so a text of
more than ``context_length × longest`` UTF-8 bytes cannot tokenize into
``context_length`` tokens or fewer, and can be refused before the tokenizer spends
seconds and hundreds of megabytes on it (an 8 MB text: 5 to 10 s and about a gigabyte
with SmolLM2's).

That holds only where tokenizing never drops or shrinks input, so the bound is given
only for tokenizers whose every stage is known (``None`` otherwise):

* the model is BPE, whose unknown characters (without byte fallback) become one unknown
  token each, at most 4 bytes; one that fuses runs of unknowns has no bound;
* the normalizer, if any, replaces literal strings with ones no shorter (SentencePiece's
  ``" "`` → ``"▁"``), prepends, or applies a Unicode normal form or lowercasing, which
  shrink a text by at most a known factor (NFC composes a Hangul syllable's 3 jamo, 9
  bytes, into 3 bytes; NFKC maps 4-byte mathematical letters to ASCII);
* the pre-tokenizer, if any, splits without removing anything (byte-level, Metaspace,
  ``Split`` and ``Punctuation`` not in ``removed`` mode, digits).

The vocabulary's own spelling is an upper bound of what an entry stands for: a
byte-level entry is decoded to its raw bytes (each byte is one character of GPT-2's
alphabet), and any other entry counts at its UTF-8 length, which is at least the input it
matches (``"▁"`` is 3 bytes for a space, unless the text holds a literal ``▁``).

``json_bytes`` bounds the same text as a JSON string, escaped as common encoders escape:
control characters and DEL as ``\\u00XX``; quotes, backslashes and ``/`` as two
bytes; the HTML-sensitive ``<``, ``>``, ``&``, ``'``, ``+`` and backtick as ``\\u00XX``
(Go, .NET); every non-ASCII character as ``\\uXXXX`` (Python's ``ensure_ascii``), an
astral one as a surrogate pair; a byte of a character split between entries counts 3
(no character's escape takes more per byte). A body carrying one prompt that fits the
context is at most ``context_length × json_bytes`` plus the other fields.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import Any

from .errors import InvalidRequest
from .token_text import BYTE_DECODER

UNKNOWN_CHAR = 4
"""Bytes of input one unknown token stands for in BPE without fused unknowns: one character."""

# How much a normalizer may shrink a text: (UTF-8 bytes, JSON-escaped bytes). A canonical
# form shrinks UTF-8 by at most 3 (the Hangul jamo above, U+1FEF → "`"); its JSON worst
# case is a 6-byte escape becoming one ASCII byte (U+037E → ";"). Compatibility forms also
# map a 4-byte character to one ASCII byte (U+1D400 → "A": 12 escaped bytes to 1).
# Lowercasing shrinks as a canonical form does (U+212A KELVIN SIGN → "k").
_SHRINK = {
    "NFC": (3, 6),
    "NFD": (3, 6),
    "NFKC": (4, 12),
    "NFKD": (4, 12),
    "Lowercase": (3, 6),
    "Prepend": (1, 1),
}
_SPLITTERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"}
_HTML_SENSITIVE = frozenset("<>&'+`\x7f")


@dataclass(frozen=True)
class TokenReach:
    """The most input one token can stand for."""

    text_bytes: int
    """UTF-8 bytes of text."""
    json_bytes: int
    """Bytes of that text inside a JSON string, at its longest common escaping."""

    def max_text_bytes(self, context_length: int) -> int:
        """Longer texts cannot fit ``context_length`` tokens."""
        return context_length * self.text_bytes

    def max_json_bytes(self, context_length: int) -> int:
        """Longer JSON strings cannot hold a text that fits."""
        return context_length * self.json_bytes


_CACHE: weakref.WeakKeyDictionary[Any, TokenReach | None] = weakref.WeakKeyDictionary()


def token_reach(tokenizer: Any) -> TokenReach | None:
    """The bound for a Hugging Face fast tokenizer, or None where none is sound. A scan of
    the vocabulary (0.1 s for SmolLM2's 49k entries, 0.4 s for Gemma 3's 262k), cached
    per tokenizer: call it off the event loop the first time."""
    try:
        return _CACHE[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: not cached
        return _compute(tokenizer)
    reach = _CACHE[tokenizer] = _compute(tokenizer)
    return reach


def refuse_unfit(text: str, reach: TokenReach, context_length: int, param: str) -> None:
    """``InvalidRequest`` (``context_length_exceeded``, naming ``param``) for a text with
    more UTF-8 bytes than ``context_length`` tokens can stand for."""
    limit = reach.max_text_bytes(context_length)
    if 4 * len(text) <= limit:  # at most 4 bytes a character: no need to count
        return
    size = len(text.encode())  # lone surrogates were refused with the JSON
    if size > limit:
        raise InvalidRequest(
            f"The prompt is {size} bytes of UTF-8, more than the model's context of "
            f"{context_length} tokens can hold: no token stands for more than "
            f"{reach.text_bytes} bytes, so at most {limit} bytes fit.",
            param,
            "context_length_exceeded",
        )


def _compute(tokenizer: Any) -> TokenReach | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    model = backend.model
    if type(model).__name__ != "BPE":
        return None
    shrink = _normalizer_shrink(_spec(backend.normalizer))
    pre = _spec(backend.pre_tokenizer)
    if shrink is None or not _splits_only(pre):
        return None
    byte_level = "ByteLevel" in _types(pre)
    floor = (0, 0)
    if model.unk_token is not None and not model.byte_fallback and not byte_level:
        if model.fuse_unk:
            return None
        floor = (UNKNOWN_CHAR, 12)
    added = {t.content for t in tokenizer.added_tokens_decoder.values()}
    spelled = [
        _raw(entry, byte_level and entry not in added)
        for entry in backend.get_vocab(with_added_tokens=True)
    ]
    spelled.sort(key=len, reverse=True)
    text_bytes = max(floor[0], len(spelled[0]) if spelled else 0)
    json_bytes = floor[1]
    for raw in spelled:
        if 6 * len(raw) <= json_bytes:  # no entry escapes to more than 6 bytes a byte
            break
        json_bytes = max(json_bytes, _escaped_len(raw))
    return TokenReach(text_bytes * shrink[0], json_bytes * shrink[1])


def _spec(component: Any) -> dict[str, Any] | None:
    """A normalizer's or pre-tokenizer's serialized form (its JSON), None if absent."""
    if component is None:
        return None
    spec: dict[str, Any] = json.loads(component.__getstate__())
    return spec


def _types(spec: dict[str, Any] | None) -> set[str]:
    if spec is None:
        return set()
    found = {spec.get("type", "")}
    for child in spec.get("normalizers", spec.get("pretokenizers", ())) or ():
        found |= _types(child)
    return found


def _normalizer_shrink(spec: dict[str, Any] | None) -> tuple[int, int] | None:
    """How much the normalizer can shrink a text (bytes, JSON bytes); None if unbounded
    or unknown."""
    if spec is None:
        return (1, 1)
    kind = spec.get("type")
    if kind == "Sequence":
        total = (1, 1)
        for child in spec.get("normalizers", ()):
            step = _normalizer_shrink(child)
            if step is None:
                return None
            total = (total[0] * step[0], total[1] * step[1])
        return total
    if kind == "Replace":
        pattern = spec.get("pattern", {}).get("String")
        content = spec.get("content", "")
        if not isinstance(pattern, str) or not pattern or not isinstance(content, str):
            return None  # a regex may match and drop anything
        shrinks = len(content.encode()) < len(pattern.encode())
        escapes_shorter = _escaped_len(content.encode()) < _escaped_len(pattern.encode())
        return None if shrinks or escapes_shorter else (1, 1)
    return _SHRINK.get(str(kind))


def _splits_only(spec: dict[str, Any] | None) -> bool:
    """Whether the pre-tokenizer keeps every byte of its input."""
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_splits_only(child) for child in spec.get("pretokenizers", ()))
    return kind in _SPLITTERS and spec.get("behavior") != "Removed"


def _raw(entry: str, byte_level: bool) -> bytes:
    if byte_level:
        try:
            return bytes(BYTE_DECODER[c] for c in entry)
        except KeyError:  # not spelled in the byte alphabet after all
            pass
    return entry.encode()


def _escaped_len(raw: bytes) -> int:
    """Bytes of ``raw`` in a JSON string at the longest escaping common encoders write."""
    total = 0
    for char in raw.decode("utf-8", "surrogateescape"):
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:  # a byte of a character split between entries
            total += 3
        elif code < 0x20 or char in _HTML_SENSITIVE:
            total += 6
        elif char in '"\\/':
            total += 2
        elif code < 0x80:
            total += 1
        else:
            total += 6 if code <= 0xFFFF else 12
    return total

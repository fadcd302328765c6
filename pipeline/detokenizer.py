"""Incremental, UTF-8 safe detokenization of a growing token sequence.

Decoding each new token on its own is wrong twice over: a byte-level token may carry only
part of a UTF-8 character, and some decoders (SentencePiece's ``▁``) change a token's text
depending on what precedes it. Decoding the whole sequence on every token is right but
quadratic. Like vLLM, SGLang and TGI, we decode a short window of recent ids and emit the
part of its text past what was already emitted, holding back a trailing U+FFFD until the
bytes that complete the character arrive.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"

# Tokens kept when the window is cut back, so that the next token decodes as it would
# mid-sequence (e.g. keeps its leading space).
_CONTEXT_TOKENS = 4
# Cut the window back once it holds more tokens than this; bounds the cost of each decode.
_WINDOW_TOKENS = 16
# Longest run of tokens held back waiting for a character to complete. Valid UTF-8 almost
# never needs more than a few; the cap keeps a model emitting stray bytes from making every
# push decode an ever longer window.
_MAX_HELD_TOKENS = 16


class IncrementalDetokenizer:
    """Turns generated token ids, pushed one at a time, into text deltas.

    The concatenation of every ``push`` and the final ``flush`` equals
    ``tokenizer.decode(generated_ids, skip_special_tokens=...)`` for valid text (given no
    ``prompt_ids``; with them it is the text the generated ids add after the prompt).
    """

    __slots__ = ("_decode", "_emitted", "_ids", "_stable")

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._decode = _decoder(tokenizer, skip_special_tokens)
        # The window of recent ids that each push decodes: ids[:_stable] have been emitted
        # in full, and _emitted chars of decode(ids) have been emitted.
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        context = self._decode(self._ids) if self._ids else ""
        if context.endswith(_REPLACEMENT):
            # The prompt ends mid-character: decode the output on its own rather than
            # letting its first bytes complete a character that belongs to the prompt.
            self._ids.clear()
            context = ""
        self._stable = len(self._ids)
        self._emitted = len(context)

    def push(self, token_id: int) -> str:
        """Append one generated id; return the text that became final."""
        ids = self._ids
        ids.append(token_id)
        text = self._decode(ids)
        if text.endswith(_REPLACEMENT):
            if len(ids) - self._stable > _MAX_HELD_TOKENS:
                return self._emit_all(text)
            # Release what precedes the incomplete character; it can no longer change.
            end = len(text.rstrip(_REPLACEMENT))
            if end <= self._emitted:
                return ""
            delta = text[self._emitted : end]
            self._emitted = end
            return delta
        delta = text[self._emitted :]
        self._emitted = max(self._emitted, len(text))
        if len(ids) > _WINDOW_TOKENS:
            del ids[:-_CONTEXT_TOKENS]
            self._emitted = len(self._decode(ids))
        self._stable = len(ids)
        return delta

    def flush(self) -> str:
        """Return whatever is still held back, decoding errors included."""
        return self._emit_all(self._decode(self._ids))

    def _emit_all(self, text: str) -> str:
        delta = text[self._emitted :]
        # Restart with an empty window: bytes arriving later must not rewrite the
        # replacement characters just emitted.
        self._ids.clear()
        self._stable = self._emitted = 0
        return delta


def _decoder(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> Callable[[list[int]], str]:
    """Pick the cheapest call that decodes exactly like ``tokenizer.decode``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        # The Rust decoder directly: transformers' wrapper adds ~2 µs of Python per call.
        def decode_backend(ids: list[int]) -> str:
            return cast(str, backend.decode(ids, skip_special_tokens=skip_special_tokens))

        return decode_backend

    def decode(ids: list[int]) -> str:
        return cast(str, tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    return decode

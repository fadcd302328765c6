"""IncrementalDetokenizer: streamed output equals a one-shot decode, never a split char."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from sluice.pipeline.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"

TEXTS = [
    "Hello, world!",
    "  leading spaces and   runs of    spaces  ",
    "line one\nline two\n\n\ttabbed\r\nwindows\n",
    "héllo café naïve résumé Ångström façade",
    "日本語のテキストと中文混合，还有標點。",
    "emoji 😀🎉👍🏽 👨‍👩‍👧 🦜🪿 flags 🇯🇵🏳️‍🌈",
    "math 𝄞 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∮ E⋅da = Q, ∀x∈ℝ",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tpass\n",
    "Ω≈ç√∫˜µ≤≥÷ ¡™£¢∞§¶•ªº",
    "mixed: abc日本😀def\u00a0nbsp\u200bzwsp",
    "Здравствуйте, мир! Γειά σου Κόσμε! مرحبا بالعالم שלום עולם",
    "ｆｕｌｌ ｗｉｄｔｈ and 한국어 텍스트 and ไทย",
    "",
    " ",
    "\n\n\n",
    "a" * 50,
]


def _sentencepiece_tokenizer() -> Any:
    """A tiny Llama-style tokenizer: '▁' for spaces, <0xNN> byte fallback, stripped start."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ["<unk>", "<s>", "</s>", *"▁abcdefghijklmnopqrstuvwxyz,.!", "▁w", "or"]:
        vocab.setdefault(piece, len(vocab))
    model = models.BPE(
        vocab=vocab, merges=[("▁", "w"), ("o", "r")], byte_fallback=True, unk_token="<unk>"
    )
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="session")
def sp_tokenizer() -> Any:
    return _sentencepiece_tokenizer()


class _SpyTokenizer:
    """Exposes only ``decode`` (so the detokenizer uses it) and records each window size."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.windows: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.windows.append(len(ids))
        return str(self.inner.decode(ids, skip_special_tokens=skip_special_tokens))


def _stream(tokenizer: Any, ids: Sequence[int], **kwargs: Any) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    return [detok.push(i) for i in ids], detok.flush()


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tokenizer: Any, text: str) -> None:
    ids = _encode(tokenizer, text)
    pieces, tail = _stream(tokenizer, ids)
    assert "".join(pieces) + tail == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tail == ""
    assert not any(REPLACEMENT in p for p in pieces)


def test_rare_characters_are_split_into_byte_tokens(tokenizer: Any) -> None:
    # Guards the tests above: they only prove something if the tokenizer splits chars.
    for char in ["🦜", "𝄞", "🪿"]:
        ids = _encode(tokenizer, f" {char}")
        assert len(ids) > 1
        assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)


def test_text_before_an_incomplete_char_is_released_at_once(tokenizer: Any) -> None:
    ids = _encode(tokenizer, "ok 🦜!")  # 'ok', ' \xf0\x9f', '\xa6', '\x9c', '!'
    pieces, tail = _stream(tokenizer, ids)
    assert pieces == ["ok", " ", "", "🦜", "!"]
    assert tail == ""


def test_long_sequence_across_many_windows(tokenizer: Any) -> None:
    text = "\n".join(TEXTS * 8)
    ids = _encode(tokenizer, text)
    assert len(ids) > 1000
    pieces, tail = _stream(tokenizer, ids)
    assert "".join(pieces) + tail == text
    assert not any(REPLACEMENT in p for p in pieces)


def test_decode_window_stays_small(tokenizer: Any) -> None:
    spy = _SpyTokenizer(tokenizer)
    ids = _encode(tokenizer, "\n".join(TEXTS * 8))
    pieces, tail = _stream(spy, ids)
    assert "".join(pieces) + tail == tokenizer.decode(ids)
    assert max(spy.windows) <= 40
    assert len(spy.windows) <= 1.2 * len(ids)


def test_special_tokens_skipped_or_kept(tokenizer: Any) -> None:
    ids = [*_encode(tokenizer, "Hi 😀"), tokenizer.eos_token_id, *_encode(tokenizer, " more")]
    for skip in (True, False):
        pieces, tail = _stream(tokenizer, ids, skip_special_tokens=skip)
        assert "".join(pieces) + tail == tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(_stream(tokenizer, ids, skip_special_tokens=False)[0]) == "Hi 😀<|im_end|> more"
    assert "".join(_stream(tokenizer, ids)[0]) == "Hi 😀 more"


def test_prompt_context_is_not_emitted(tokenizer: Any) -> None:
    prompt = _encode(tokenizer, "<|im_start|>user\nSay hi 日本<|im_end|>\n<|im_start|>assistant\n")
    generated = _encode(tokenizer, "Hello there, 🦜 friend")
    for skip in (True, False):
        pieces, tail = _stream(tokenizer, generated, prompt_ids=prompt, skip_special_tokens=skip)
        assert "".join(pieces) + tail == "Hello there, 🦜 friend"


def test_prompt_ending_mid_character_does_not_leak(tokenizer: Any) -> None:
    ids = _encode(tokenizer, "look 🦜 ok")
    split = 2  # 'look', ' \xf0\x9f' | '\xa6', '\x9c', ' ok'
    assert REPLACEMENT in tokenizer.decode(ids[:split])
    pieces, tail = _stream(tokenizer, ids[split:], prompt_ids=ids[:split])
    assert "".join(pieces) + tail == tokenizer.decode(ids[split:])


def test_incomplete_char_at_the_end_comes_out_of_flush(tokenizer: Any) -> None:
    ids = _encode(tokenizer, "ok 🦜")[:-1]
    pieces, tail = _stream(tokenizer, ids)
    assert pieces == ["ok", " ", ""]
    assert tail == REPLACEMENT
    assert "".join(pieces) + tail == tokenizer.decode(ids)


def test_literal_replacement_char_is_text(tokenizer: Any) -> None:
    for text in [f"a{REPLACEMENT}b", f"ends with {REPLACEMENT}"]:
        ids = _encode(tokenizer, text)
        pieces, tail = _stream(tokenizer, ids)
        assert "".join(pieces) + tail == text


def test_stray_bytes_are_emitted_and_bounded(tokenizer: Any) -> None:
    lead_byte = tokenizer.convert_tokens_to_ids("æ")  # 0xE6: starts a 3-byte char
    ids = [lead_byte] * 100 + _encode(tokenizer, " fine")
    spy = _SpyTokenizer(tokenizer)
    pieces, tail = _stream(spy, ids)
    assert "".join(pieces) + tail == tokenizer.decode(ids) == REPLACEMENT * 100 + " fine"
    assert max(spy.windows) <= 40


def test_push_after_flush_continues(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    first, second = _encode(tokenizer, "one"), _encode(tokenizer, " two")
    out = [detok.push(i) for i in first] + [detok.flush()] + [detok.push(i) for i in second]
    assert "".join(out) == "one two"


@pytest.mark.parametrize("text", ["hello world", "hello world 日本 é!", "a, b. c!", "日本"])
def test_sentencepiece_style_tokenizer(sp_tokenizer: Any, text: str) -> None:
    ids = _encode(sp_tokenizer, text)
    pieces, tail = _stream(sp_tokenizer, ids)
    assert "".join(pieces) + tail == sp_tokenizer.decode(ids) == text
    assert not any(REPLACEMENT in p for p in pieces)


def test_sentencepiece_prompt_context_keeps_leading_space(sp_tokenizer: Any) -> None:
    ids = _encode(sp_tokenizer, "hello world")
    split = sp_tokenizer.convert_ids_to_tokens(ids).index("▁w")
    assert sp_tokenizer.decode(ids[split:]) == "world"  # decoded alone, the space is stripped
    pieces, tail = _stream(sp_tokenizer, ids[split:], prompt_ids=ids[:split])
    assert "".join(pieces) + tail == " world"

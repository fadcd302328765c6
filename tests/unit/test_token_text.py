"""TokenTexts: per-token text and bytes as OpenAI logprobs show them."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.pipeline.token_text import TokenTexts

REPLACEMENT = "\ufffd"

TEXTS = [
    "Hello, world!  two  spaces\n\nnew lines\ttab",
    "héllo café naïve Ångström",
    "日本語のテキストと中文混合",
    "emoji 😀🎉👍🏽 👨‍👩‍👧 🦜🪿 🇯🇵",
    "math 𝄞 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∮ E⋅da = Q",
    "def f(x):\n    return {'a': [1, 2, 3]}  # \\ backslash\n",
    "Здравствуйте мир, 한국어, ไทย",
]


@pytest.fixture(scope="session")
def texts(tokenizer: Any) -> TokenTexts:
    return TokenTexts(tokenizer)


def _id(tokenizer: Any, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(token_id, int)
    assert tokenizer.convert_ids_to_tokens(token_id) == token
    return token_id


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_text(tokenizer: Any, texts: TokenTexts, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(bytes(texts.bytes(i)) for i in ids) == text.encode()


def test_whole_vocabulary(tokenizer: Any, texts: TokenTexts) -> None:
    partial = 0
    for token_id in range(len(tokenizer)):
        decoded = tokenizer.decode([token_id])
        text, raw = texts.text(token_id), bytes(texts.bytes(token_id))
        assert raw.decode(errors="replace") == decoded
        try:
            assert text == decoded == raw.decode()
        except UnicodeDecodeError:
            partial += 1
            assert text.startswith("bytes:")
            assert REPLACEMENT not in text
    assert partial > 100  # byte-level BPE has many tokens that are not whole characters


def test_incomplete_utf8_uses_the_bytes_convention(tokenizer: Any, texts: TokenTexts) -> None:
    lead = _id(tokenizer, "ĠðŁ")  # " \xf0\x9f": a space and half an emoji
    assert texts.text(lead) == "bytes: \\xf0\\x9f"
    assert texts.bytes(lead) == (0x20, 0xF0, 0x9F)
    continuation = _id(tokenizer, "¦")  # 0xA6 alone
    assert texts.text(continuation) == "bytes:\\xa6"
    assert texts.bytes(continuation) == (0xA6,)


def test_whole_characters(tokenizer: Any, texts: TokenTexts) -> None:
    assert texts.text(_id(tokenizer, "Ġworld")) == " world"
    assert texts.bytes(_id(tokenizer, "Ġworld")) == tuple(b" world")
    assert texts.text(_id(tokenizer, "Ċ")) == "\n"
    assert texts.text(_id(tokenizer, "Ã©")) == "é"
    assert texts.bytes(_id(tokenizer, "Ã©")) == (0xC3, 0xA9)


def test_special_tokens_show_literally(tokenizer: Any, texts: TokenTexts) -> None:
    assert texts.text(tokenizer.eos_token_id) == "<|im_end|>"
    assert texts.bytes(tokenizer.eos_token_id) == tuple(b"<|im_end|>")
    assert texts.text(_id(tokenizer, "<|im_start|>")) == "<|im_start|>"


def test_cached_per_id(tokenizer: Any, texts: TokenTexts) -> None:
    token_id = _id(tokenizer, "Ġhello")
    assert texts.text(token_id) is texts.text(token_id)
    assert texts.bytes(token_id) is texts.bytes(token_id)


def test_id_outside_vocabulary(tokenizer: Any, texts: TokenTexts) -> None:
    assert texts.text(len(tokenizer) + 7) == ""
    assert texts.bytes(len(tokenizer) + 7) == ()


def _sentencepiece_tokenizer() -> Any:
    """A tiny Llama-style tokenizer: '▁' for spaces, <0xNN> byte fallback, no ByteLevel."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ["<unk>", "<s>", "</s>", *"▁abcdefghijklmnopqrstuvwxyz", "▁w"]:
        vocab.setdefault(piece, len(vocab))
    model = models.BPE(vocab=vocab, merges=[("▁", "w")], byte_fallback=True, unk_token="<unk>")
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_byte_fallback_tokenizer() -> None:
    tokenizer = _sentencepiece_tokenizer()
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("ab 日", add_special_tokens=False)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens == ["▁", "a", "b", "▁", "<0xE6>", "<0x97>", "<0xA5>"]
    assert [texts.text(i) for i in ids[4:]] == ["bytes:\\xe6", "bytes:\\x97", "bytes:\\xa5"]
    assert b"".join(bytes(texts.bytes(i)) for i in ids[4:]) == "日".encode()
    assert texts.text(_id(tokenizer, "<0x41>")) == "A"  # a byte token that is a whole char
    # No byte-level alphabet: other tokens fall back to decode([id]).
    assert texts.text(_id(tokenizer, "a")) == "a"
    assert texts.text(_id(tokenizer, "▁w")) == tokenizer.decode([_id(tokenizer, "▁w")])
    assert texts.text(_id(tokenizer, "</s>")) == "</s>"


def test_added_tokens_are_not_read_as_byte_level() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    tokenizer.add_tokens(["<é>"], special_tokens=True)
    tokenizer.add_tokens(["Ġcafé"])
    texts = TokenTexts(tokenizer)
    # Read through the byte-level alphabet, "é" would be the lone byte 0xE9.
    assert texts.text(_id(tokenizer, "<é>")) == "<é>"
    assert texts.bytes(_id(tokenizer, "<é>")) == tuple("<é>".encode())
    assert texts.text(_id(tokenizer, "Ġcafé")) == "Ġcafé"
    ids = tokenizer.encode("é", add_special_tokens=False)
    assert [texts.text(i) for i in ids] == ["bytes:\\xc3", "bytes:\\xa9"]

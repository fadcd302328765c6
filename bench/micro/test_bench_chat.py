"""Micro-benchmark of the chat tokenize stage: template rendering plus tokenization
of a typical request (system + 3 turns), per request."""

from __future__ import annotations

from typing import Any

from sluice.pipeline.chat import ChatSetup, render_prompt_ids

MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one word."},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy? " * 8},
]


def test_render_and_tokenize_chat_request(benchmark: Any, tokenizer: Any) -> None:
    setup = ChatSetup.for_tokenizer(None, tokenizer)
    assert setup is not None
    ids = benchmark(render_prompt_ids, setup, tokenizer, MESSAGES, False, {}, None)
    assert len(ids) > 40

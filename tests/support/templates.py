"""Chat-template fixtures: the default model's own template, a conversation with its
expected rendering, and resolving a ``--chat-template`` spec."""

from __future__ import annotations

import json
from pathlib import Path

from sluice.pipeline.chat_template import (
    ChatTemplate,
)
from sluice.pipeline.template_sources import (
    resolve_chat_template,
)
from tests.conftest import missing_model

CACHE = Path(__file__).resolve().parents[2] / "models" / "cache"


SMOL_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]


EXPECTED = {
    "chatml": (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "llama-3": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "mistral": "<s>[INST] Hi[/INST] Hello!</s>[INST] You are terse.\n\nWhat is 2+2?[/INST]",
    "qwen2.5": (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "gemma": (
        "<bos><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n"
    ),
    "deepseek-v3": (
        "<｜begin▁of▁sentence｜>You are terse.<｜User｜>Hi"
        "<｜Assistant｜>Hello!<｜end▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜>"
    ),
}


def resolve(spec: str | None, tokenizer_template: str | None = None) -> ChatTemplate:
    return resolve_chat_template(
        spec, tokenizer_template=tokenizer_template, bos_token="<B>", eos_token="<E>"
    )


def smollm_template() -> str:
    """SmolLM2's own template, from a tokenizer folder saved next to the model."""
    for path in sorted(CACHE.glob("*/chat_template.jinja")):
        return path.read_text(encoding="utf-8")
    for path in sorted(CACHE.glob("*/tokenizer_config.json")):
        source = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(source, str):
            return source
    missing_model("no saved tokenizer folder with SmolLM2's chat template under models/cache")


PARTS = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]


SMOL_BOS, SMOL_EOS = "<|im_start|>", "<|im_end|>"

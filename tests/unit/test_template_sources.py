"""Where a chat template comes from: every --chat-template form (built-in names, Jinja and
HF-style JSON files, SGLang's conversation JSON) and the default model's own template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.pipeline.chat_template import (
    ChatTemplate,
    TemplateConfigError,
    TemplateError,
)
from sluice.pipeline.template_sources import (
    BUILTIN_NAMES,
    conversation_template,
    resolve_chat_template,
)
from tests.conftest import missing_model
from tests.support.templates import (
    CACHE,
    CONVERSATION,
    EXPECTED,
    PARTS,
    SMOL_BOS,
    SMOL_DEFAULT_SYSTEM,
    SMOL_EOS,
    resolve,
    smollm_template,
)

# --- resolution: every source form ---------------------------------------------------------------


def test_builtin_name_wins_over_a_file_of_that_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "chatml").write_text("not a template {{", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    template = resolve("chatml")
    assert template.origin == "built-in chatml"
    assert template.render(CONVERSATION, add_generation_prompt=True) == EXPECTED["chatml"]


def test_jinja_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(
        "\n{{ bos_token }}{% for m in messages %}{{ m.content }}\\n{% endfor %}{{ eos_token }}\n",
        encoding="utf-8",
    )
    template = resolve(str(path))
    assert template.render(CONVERSATION[1:3], add_generation_prompt=False) == "<B>Hi\nHello!\n<E>"


def test_other_non_json_file_is_jinja(tmp_path: Path) -> None:
    path = tmp_path / "template.txt"
    path.write_text("{{ messages[0].content }}!", encoding="utf-8")
    assert resolve(str(path)).render(CONVERSATION, add_generation_prompt=False) == "You are terse.!"


def test_hf_json_with_a_string(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer_config.json"
    source = "{% for m in messages %}<{{ m.role }}>{% endfor %}"
    path.write_text(json.dumps({"chat_template": source, "bos_token": "x"}), encoding="utf-8")
    template = resolve(str(path))
    assert template.source == source
    assert template.render(CONVERSATION[:2], add_generation_prompt=False) == "<system><user>"


def test_hf_json_with_named_templates(tmp_path: Path) -> None:
    named = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "default {{ messages | length }}"},
    ]
    nested = tmp_path / "nested.json"
    nested.write_text(json.dumps({"chat_template": named}), encoding="utf-8")
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(named), encoding="utf-8")
    for path in (nested, bare):
        assert resolve(str(path)).render(CONVERSATION, add_generation_prompt=False) == "default 4"


def test_hf_json_without_default_lists_its_templates(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"chat_template": [{"name": "rag", "template": "r"}]}), "utf-8")
    with pytest.raises(TemplateConfigError, match="rag"):
        resolve(str(path))


def test_json_file_is_never_jinja_source(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text("{{ messages[0].content }}", encoding="utf-8")
    with pytest.raises(TemplateConfigError, match="JSON"):
        resolve(str(path))
    path.write_text(json.dumps({"template": "{{ 1 }}"}), encoding="utf-8")
    with pytest.raises(TemplateConfigError, match="chat_template"):
        resolve(str(path))


LEGACY: dict[str, tuple[dict[str, str | list[str]], str]] = {
    "CHATML": (
        {
            "system": "<|im_start|>system",
            "user": "<|im_start|>user",
            "assistant": "<|im_start|>assistant",
            "sep": "<|im_end|>",
            "stop_str": ["<|im_end|>"],
        },
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    "ADD_COLON_SINGLE": (
        {
            "system": "### System",
            "user": "### User",
            "assistant": "### Assistant",
            "stop_str": "###",
        },
        "### System\nS\n### User: Hi\n### Assistant: Hello!\n### User: Q?\n### Assistant:",
    ),
    "ADD_COLON_TWO": (
        {
            "system": "SYSTEM:",
            "user": "USER",
            "assistant": "ASSISTANT",
            "sep": " ",
            "sep2": "</s>",
            "stop_str": "</s>",
        },
        "SYSTEM:\nS USER: Hi ASSISTANT: Hello!</s>USER: Q? ASSISTANT:",
    ),
    "NO_COLON_SINGLE": (
        {
            "system": "<|system|>",
            "user": "<|user|>\n",
            "assistant": "<|assistant|>\n",
            "sep": "<|end|>\n",
            "stop_str": "<|end|>",
        },
        "<|system|>\nS<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n<|user|>\nQ?<|end|>\n"
        "<|assistant|>\n",
    ),
    "LLAMA3": (
        {
            "system": "<|start_header_id|>system<|end_header_id|>\n",
            "user": "user",
            "assistant": "assistant",
            "sep": "",
            "stop_str": ["<|eot_id|>"],
        },
        "<|start_header_id|>system<|end_header_id|>\n\nS"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nQ?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
}
LEGACY_CONVERSATION = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Q?"},
]


@pytest.mark.parametrize("style", sorted(LEGACY))
def test_sglang_conversation_json(tmp_path: Path, style: str) -> None:
    fields, expected = LEGACY[style]
    path = tmp_path / "conv.json"
    path.write_text(json.dumps({"name": "mine", "sep_style": style, **fields}), "utf-8")
    template = resolve(str(path))
    assert template.render(LEGACY_CONVERSATION, add_generation_prompt=True) == expected
    stop = fields["stop_str"]
    assert template.stop == ((stop,) if isinstance(stop, str) else tuple(stop))
    assert template.add_special_tokens


def test_sglang_conversation_defaults_and_continuation() -> None:
    template = conversation_template(
        {
            "name": "v",
            "system": "SYSTEM:",
            "user": "USER",
            "assistant": "ASSISTANT",
            "sep_style": "ADD_COLON_SINGLE",
            "stop_str": "</s>",
            "system_message": "Be nice.",
        }
    )
    assert template.render(LEGACY_CONVERSATION[1:3], add_generation_prompt=False) == (
        "SYSTEM:\nBe nice.\nUSER: Hi\nASSISTANT: Hello!\n"
    )
    assert template.render(
        LEGACY_CONVERSATION[1:3], add_generation_prompt=True, continue_final_message=True
    ) == ("SYSTEM:\nBe nice.\nUSER: Hi\nASSISTANT: Hello!")
    with pytest.raises(TemplateError, match="Unknown role: tool"):
        template.render([{"role": "tool", "content": "x"}], add_generation_prompt=True)


def test_sglang_conversation_literals_survive_escaping() -> None:
    odd = 'it\'s "quoted" \\ {{ not jinja }} an image é\t'
    template = conversation_template(
        {
            "name": "odd",
            "system": odd,
            "user": "U",
            "assistant": "A",
            "sep_style": "NO_COLON_SINGLE",
            "sep": "|",
            "stop_str": "|",
        }
    )
    assert template.content_format == "string"
    assert template.render([], add_generation_prompt=True) == odd + "\nA"
    parts = [{"role": "user", "content": PARTS}]
    assert template.render(parts, add_generation_prompt=False) == odd + "\nUone two|"


def test_sglang_conversation_errors() -> None:
    base = {"name": "x", "system": "", "user": "U", "assistant": "A", "stop_str": "s"}
    with pytest.raises(TemplateConfigError, match="DOLLY"):
        conversation_template({**base, "sep_style": "DOLLY"})
    with pytest.raises(TemplateConfigError, match="sep_style"):
        conversation_template(base)


def test_tokenizer_template_without_spec() -> None:
    template = resolve(None, tokenizer_template="{{ bos_token }}{{ messages[0].content }}")
    assert template.render(CONVERSATION, add_generation_prompt=False) == "<B>You are terse."
    assert template.origin == "the tokenizer"


def test_no_template_at_all_is_an_error() -> None:
    with pytest.raises(TemplateConfigError, match="no chat template"):
        resolve(None)


def test_bad_spec_lists_the_builtin_names(tmp_path: Path) -> None:
    with pytest.raises(TemplateConfigError) as caught:
        resolve(str(tmp_path / "missing.jinja"))
    assert all(name in str(caught.value) for name in BUILTIN_NAMES)
    with pytest.raises(TemplateConfigError, match="chatml"):
        resolve("chat-ml")


# --- the default model's own template ------------------------------------------------------------


def smollm() -> ChatTemplate:
    return resolve_chat_template(
        None, tokenizer_template=smollm_template(), bos_token=SMOL_BOS, eos_token=SMOL_EOS
    )


def test_smollm_inserts_its_default_system_message() -> None:
    rendered = smollm().render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert rendered == (
        f"<|im_start|>system\n{SMOL_DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_smollm_renders_known_conversation() -> None:
    template = smollm()
    assert template.content_format == "string"
    assert template.render(CONVERSATION, add_generation_prompt=True) == EXPECTED["chatml"]


def test_smollm_user_text_never_becomes_a_control_token() -> None:
    """Tokenizing the segments as the caller will: message text with special tokens split."""
    tokenizers = pytest.importorskip("tokenizers")
    paths = sorted(CACHE.glob("*/tokenizer.json"))
    if not paths:
        missing_model("no saved tokenizer.json under models/cache")
    tokenizer = tokenizers.Tokenizer.from_file(str(paths[0]))
    im_end = tokenizer.token_to_id("<|im_end|>")
    messages = [{"role": "user", "content": "Say <|im_end|> twice: <|im_end|>"}]
    ids: list[int] = []
    for text, is_template in smollm().render_segments(messages, add_generation_prompt=True):
        tokenizer.encode_special_tokens = not is_template
        ids += tokenizer.encode(text, add_special_tokens=False).ids
    assert ids.count(im_end) == 2  # the system turn's and the user turn's, none from the text

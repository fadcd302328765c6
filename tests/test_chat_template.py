"""Chat templates: every source form, the built-ins' exact prompts, the sandbox, user text."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from sluice.pipeline.chat_template import (
    ChatTemplate,
    TemplateConfigError,
    TemplateError,
    detect_content_format,
)
from sluice.pipeline.template_sources import (
    BUILTIN_NAMES,
    builtin_template,
    conversation_template,
    resolve_chat_template,
)

from .conftest import missing_model

CACHE = Path(__file__).resolve().parents[1] / "models" / "cache"
SMOL_BOS, SMOL_EOS = "<|im_start|>", "<|im_end|>"
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

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
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


# --- built-ins -----------------------------------------------------------------------------------


def test_every_builtin_has_an_expected_prompt() -> None:
    assert set(BUILTIN_NAMES) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_builtin_renders_known_conversation(name: str) -> None:
    template = resolve(name)
    assert template.render(CONVERSATION, add_generation_prompt=True) == EXPECTED[name]


def test_builtins_carry_their_tokens_and_stops() -> None:
    chatml = builtin_template("chatml")
    assert "<|im_end|>" in chatml.stop
    llama = resolve("llama-3")
    assert (llama.bos_token, llama.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
    assert "<|eot_id|>" in llama.stop
    assert builtin_template("deepseek-v3").stop == ("<｜end▁of▁sentence｜>",)
    assert not llama.add_special_tokens


def test_chatml_without_system_message_uses_sglang_default() -> None:
    rendered = builtin_template("chatml").render(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True
    )
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_generation_prompt_is_optional() -> None:
    rendered = builtin_template("llama-3").render(CONVERSATION[:2], add_generation_prompt=False)
    assert rendered == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    )


def test_trim_in_template_still_strips_message_whitespace() -> None:
    messages = [{"role": "user", "content": "  Hi \n"}]
    rendered = builtin_template("llama-3").render(messages, add_generation_prompt=False)
    assert rendered == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"


def test_template_exception_is_ours_with_its_message() -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateError, match=r"^Conversation roles must alternate"):
        builtin_template("gemma").render(messages, add_generation_prompt=True)


# --- tools, documents, kwargs --------------------------------------------------------------------


def test_qwen_tools_reach_the_template() -> None:
    rendered = builtin_template("qwen2.5").render(
        [{"role": "user", "content": "Weather in Paris?"}],
        add_generation_prompt=True,
        tools=[WEATHER_TOOL],
    )
    assert rendered == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": '
        '"Weather in a city", "parameters": {"type": "object", "properties": {"city": '
        '{"type": "string"}}}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen_tool_call_history() -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    rendered = builtin_template("qwen2.5").render(messages, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tools_are_retried_flattened_as_sglang_does() -> None:
    template = ChatTemplate("{% for tool in tools %}{{ tool.name.upper() }}{% endfor %}")
    rendered = template.render([], add_generation_prompt=False, tools=[WEATHER_TOOL])
    assert rendered == "GET_WEATHER"


def test_inputs_reach_the_template() -> None:
    template = ChatTemplate(
        "{{ bos_token }}|{{ eos_token }}|{{ enable_thinking }}|{{ reasoning_effort }}|"
        "{{ documents[0].title }}|{{ reasoning_effort is defined }}",
        bos_token="<s>",
        eos_token="</s>",
    )
    rendered = template.render(
        [],
        add_generation_prompt=False,
        documents=[{"title": "Doc"}],
        template_kwargs={"enable_thinking": False},
        reasoning_effort="low",
    )
    assert rendered == "<s>|</s>|False|low|Doc|True"
    unset = ChatTemplate("{{ reasoning_effort is defined }}")
    assert unset.render([], add_generation_prompt=False) == "False"


def test_template_kwargs_cannot_replace_the_conversation() -> None:
    with pytest.raises(TemplateError, match="messages"):
        ChatTemplate("x").render([], add_generation_prompt=False, template_kwargs={"messages": []})


# --- environment: globals, filters, sandbox ------------------------------------------------------


def test_raise_exception_is_our_template_error() -> None:
    template = ChatTemplate("{{ raise_exception('no system role, please') }}")
    with pytest.raises(TemplateError) as caught:
        template.render([], add_generation_prompt=True)
    assert str(caught.value) == "no system role, please"


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{% set ns = namespace(_hidden=1) %}",
        "{{ dict.mro() }}",
    ],
)
def test_sandbox_escape_is_a_template_error(source: str) -> None:
    with pytest.raises(TemplateError):
        ChatTemplate(source).render([], add_generation_prompt=False)


def test_templates_cannot_modify_inputs() -> None:
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages.append(1) }}").render(messages, add_generation_prompt=False)
    assert messages == [{"role": "user", "content": "x"}]


def test_tojson_takes_transformers_arguments() -> None:
    template = ChatTemplate(
        "{{ data | tojson }}#{{ data | tojson(indent=2, sort_keys=True) }}#"
        "{{ data | tojson(separators=(',', ':')) }}#{{ data | tojson(ensure_ascii=True) }}"
    )
    rendered = template.render(
        [], add_generation_prompt=False, template_kwargs={"data": {"b": "<é>", "a": 1}}
    )
    assert rendered.split("#") == [
        '{"b": "<é>", "a": 1}',
        '{\n  "a": 1,\n  "b": "<é>"\n}',
        '{"b":"<é>","a":1}',
        '{"b": "<\\u00e9>", "a": 1}',
    ]


def test_tojson_of_message_text_keeps_it_marked() -> None:
    template = ChatTemplate(
        "{% for m in messages %}{{ m.content | tojson(ensure_ascii=True) }}{% endfor %}"
    )
    messages = [{"role": "user", "content": "é<|im_end|>"}]
    segments = template.render_segments(messages, add_generation_prompt=False)
    assert segments == [('"', True), ("\\u00e9<|im_end|>", False), ('"', True)]


def test_strftime_now_loop_controls_and_generation_block() -> None:
    template = ChatTemplate(
        "{{ strftime_now('%Y') }}|"
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content }}{% endfor %}|"
        "{% generation %}{{ 'kept' }}{% endgeneration %}"
    )
    rendered = template.render(CONVERSATION, add_generation_prompt=False)
    assert rendered == f"{datetime.datetime.now().year}|Hi|kept"


def test_syntax_error_is_a_config_error() -> None:
    with pytest.raises(TemplateConfigError, match="not a valid chat template"):
        ChatTemplate("{% for m in messages %}")


# --- content format ------------------------------------------------------------------------------

PARTS_TEMPLATE = (
    "{% for message in messages %}{{ message.role }}:{% for part in message['content'] %}"
    "[{{ part.type }}={{ part.text }}]{% endfor %};{% endfor %}"
)
STRING_TEMPLATE = (
    "{% for message in messages %}{{ message.role }}:({{ message.content }});{% endfor %}"
)
PARTS = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]


def test_content_format_detection() -> None:
    assert detect_content_format(STRING_TEMPLATE) == "string"
    assert detect_content_format(PARTS_TEMPLATE) == "openai"
    assert detect_content_format("{% for c in msg.content | list %}{% endfor %}") == "openai"
    assert detect_content_format("{{ '<image>' }}") == "openai"
    assert builtin_template("gemma").content_format == "openai"
    assert builtin_template("qwen2.5").content_format == "string"


def test_string_template_gets_text_parts_joined() -> None:
    rendered = ChatTemplate(STRING_TEMPLATE).render(
        [{"role": "user", "content": PARTS}], add_generation_prompt=False
    )
    assert rendered == "user:(one two);"


def test_parts_template_gets_text_parts() -> None:
    rendered = ChatTemplate(PARTS_TEMPLATE).render(
        [{"role": "user", "content": PARTS}], add_generation_prompt=False
    )
    assert rendered == "user:[text=one][text=two];"


def test_media_parts_are_refused() -> None:
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    with pytest.raises(TemplateError, match="text only"):
        ChatTemplate(PARTS_TEMPLATE).render(
            [{"role": "user", "content": [image]}], add_generation_prompt=False
        )


def test_null_content_is_empty_and_null_keys_dropped() -> None:
    template = ChatTemplate(
        "{% for m in messages %}[{{ m.content }}]{{ m.name is defined }}{% endfor %}"
    )
    messages = [{"role": "assistant", "content": None, "name": None}]
    assert template.render(messages, add_generation_prompt=False) == "[]False"


# --- continue_final_message ----------------------------------------------------------------------

PARTIAL = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is "}]


def test_continue_final_message_keeps_the_turn_open() -> None:
    rendered = builtin_template("chatml").render(
        PARTIAL, add_generation_prompt=True, continue_final_message=True
    )
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe answer is "
    )


def test_continue_final_message_after_a_trimming_template() -> None:
    rendered = builtin_template("llama-3").render(
        PARTIAL, add_generation_prompt=False, continue_final_message=True
    )
    assert rendered == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nThe answer is"
    )


def test_continue_final_message_with_parts() -> None:
    messages = [{"role": "user", "content": PARTS}, {"role": "assistant", "content": PARTS}]
    rendered = ChatTemplate(PARTS_TEMPLATE).render(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert rendered == "user:[text=one][text=two];assistant:[text=one][text=two"


def test_continue_final_message_needs_an_assistant_message_last() -> None:
    with pytest.raises(TemplateError, match="assistant"):
        builtin_template("chatml").render(
            PARTIAL[:1], add_generation_prompt=True, continue_final_message=True
        )


def test_continue_final_message_needs_the_template_to_render_it() -> None:
    template = ChatTemplate(
        "{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}"
    )
    with pytest.raises(TemplateError, match="does not render the final message"):
        template.render(PARTIAL, add_generation_prompt=False, continue_final_message=True)


# --- segments ------------------------------------------------------------------------------------


def test_segments_mark_user_text_containing_control_tokens() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "a<|im_end|>b"}]
    template = builtin_template("chatml")
    segments = template.render_segments(messages, add_generation_prompt=True)
    assert segments == [
        ("<|im_start|>system", True),
        ("\nS", False),
        ("<|im_end|>\n<|im_start|>user", True),
        ("\na<|im_end|>b", False),
        ("<|im_end|>\n<|im_start|>assistant\n", True),
    ]
    assert "".join(text for text, _ in segments) == template.render(
        messages, add_generation_prompt=True
    )


def test_leading_space_moves_into_user_text() -> None:
    segments = builtin_template("mistral").render_segments(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True
    )
    assert segments == [("<s>[INST]", True), (" Hi", False), ("[/INST]", True)]


def test_text_cut_apart_by_the_template_stays_exact() -> None:
    template = ChatTemplate("{% for m in messages %}<{{ m.content.split('|')[-1] }}>{% endfor %}")
    messages = [{"role": "user", "content": "a|b"}]
    assert template.render_segments(messages, add_generation_prompt=False) == [("<b>", True)]


def test_reserved_characters_are_refused() -> None:
    with pytest.raises(TemplateError, match="reserved character"):
        builtin_template("chatml").render(
            [{"role": "user", "content": "a\ufdd1b"}], add_generation_prompt=True
        )
    with pytest.raises(TemplateError, match="reserved character"):
        builtin_template("qwen2.5").render(
            [{"role": "user", "content": "a"}],
            add_generation_prompt=True,
            tools=[{"type": "function", "function": {"name": "\ufdd0"}}],
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

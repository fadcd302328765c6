"""Chat templates: every source form, the built-ins' exact prompts, the sandbox, user text."""

from __future__ import annotations

import datetime

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
)
from tests.support.templates import (
    CONVERSATION,
    EXPECTED,
    PARTS,
    resolve,
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


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

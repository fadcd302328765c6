"""Where a chat template comes from (``--chat-template``): a built-in name, SGLang's
legacy conversation JSON, a Jinja or HF-style JSON file, or the model's own; resolution
follows SGLang."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from string import Template

from .chat_template import ChatTemplate, TemplateConfigError

# --- built-in templates ------------------------------------------------------------------------

_CHATML = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = 'You are a helpful assistant.' %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '<|im_start|>system\n' + system_message + '<|im_end|>\n' }}
{%- for message in loop_messages %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# meta-llama/Meta-Llama-3-8B-Instruct
_LLAMA_3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

# mistralai/Mistral-7B-Instruct-v0.3
_MISTRAL = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""  # noqa: E501 - the official source, verbatim

# Qwen/Qwen2.5-7B-Instruct
_QWEN_2_5 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501 - the official source, verbatim

# google/gemma-3-4b-it
_GEMMA = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# deepseek-ai/DeepSeek-V3
_DEEPSEEK_V3 = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
    "{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, "
    "system_prompt='', is_first_sp=true) %}{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    "{% set ns.is_first_sp = false %}{%- else %}"
    "{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}"
    "{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is none %}"
    "{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls']%}"
    "{%- if not ns.is_first %}"
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type']"
    " + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n'"
    " + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- set ns.is_first = true -%}{%- else %}"
    "{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'"
    " + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments']"
    " + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}"
    "{%- if ns.is_tool %}"
    "{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}"
    "{%- set ns.is_tool = false -%}{%- else %}"
    "{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}"
    "{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}"
    "{%- if ns.is_output_first %}"
    "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content']"
    " + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}"
    "{{'\\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"
    "{%- endif %}{%- endif %}{%- endfor -%}"
    "{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"
)


@dataclass(frozen=True)
class _Builtin:
    source: str
    bos_token: str
    eos_token: str
    stop: tuple[str, ...]


_BUILTINS: Mapping[str, _Builtin] = {
    "chatml": _Builtin(_CHATML, "", "<|im_end|>", ("<|endoftext|>", "<|im_end|>")),
    "llama-3": _Builtin(
        _LLAMA_3, "<|begin_of_text|>", "<|eot_id|>", ("<|eot_id|>", "<|end_of_text|>")
    ),
    "mistral": _Builtin(_MISTRAL, "<s>", "</s>", ("</s>",)),
    "qwen2.5": _Builtin(_QWEN_2_5, "", "<|im_end|>", ("<|im_end|>", "<|endoftext|>")),
    "gemma": _Builtin(_GEMMA, "<bos>", "<eos>", ("<end_of_turn>", "<eos>")),
    "deepseek-v3": _Builtin(
        _DEEPSEEK_V3, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", ("<｜end▁of▁sentence｜>",)
    ),
}
BUILTIN_NAMES: tuple[str, ...] = tuple(_BUILTINS)


def builtin_template(name: str) -> ChatTemplate:
    """A built-in template by name, with its own BOS/EOS tokens and stop strings."""
    builtin = _BUILTINS[name]
    return ChatTemplate(
        builtin.source,
        bos_token=builtin.bos_token,
        eos_token=builtin.eos_token,
        stop=builtin.stop,
        origin=f"built-in {name}",
    )


# --- SGLang's legacy conversation JSON -----------------------------------------------------------

# Per separator style (SGLang's conversation.py, get_prompt): the prompt's start, a message with
# text, and a message without (the generation prompt), as Jinja expressions.
_SEP_STYLES: Mapping[str, tuple[str, str, str]] = {
    "ADD_COLON_SINGLE": ("system_prompt + sep", "role + ': ' + content + sep", "role + ':'"),
    "ADD_COLON_TWO": (
        "system_prompt + sep",
        "role + ': ' + content + (sep if i is even else sep2)",
        "role + ':'",
    ),
    "ADD_COLON_SPACE_SINGLE": ("system_prompt + sep", "role + ': ' + content + sep", "role + ': '"),
    "NO_COLON_SINGLE": ("system_prompt", "role + content + sep", "role"),
    "NO_COLON_TWO": ("system_prompt", "role + content + (sep if i is even else sep2)", "role"),
    "ADD_NEW_LINE_SINGLE": ("system_prompt + sep", "role + '\\n' + content + sep", "role + '\\n'"),
    "CHATML": (
        "system_prompt + sep + '\\n'",
        "role + '\\n' + content + sep + '\\n'",
        "role + '\\n'",
    ),
    "LLAMA3": (
        "system_prompt if system_message else ''",
        "'<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + content | trim + '<|eot_id|>'",
        "'<|start_header_id|>' + role + '<|end_header_id|>\\n\\n'",
    ),
}

# SGLang's generate_chat_conv: the last system message wins, wherever it is; other roles than
# user and assistant are refused; a message with empty text renders like the generation prompt.
_CONVERSATION = Template(
    """\
{%- set ns = namespace(system_message=$system_message) -%}
{%- for message in messages -%}
  {%- if message.role == 'system' -%}
    {%- set ns.system_message = message.content -%}
  {%- elif message.role not in ('user', 'assistant') -%}
    {{- raise_exception('Unknown role: ' + message.role) -}}
  {%- endif -%}
{%- endfor -%}
{%- set system_message = ns.system_message -%}
{%- set system_prompt = $system + '\\n' + system_message -%}
{%- set sep = $sep -%}
{%- set sep2 = $sep2 -%}
{{- $prefix -}}
{%- for message in messages | rejectattr('role', 'equalto', 'system') -%}
  {%- set i = loop.index0 -%}
  {%- set role = $user if message.role == 'user' else $assistant -%}
  {%- set content = message.content -%}
  {%- if content -%}{{- $message -}}{%- else -%}{{- $blank -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {%- set role = $assistant -%}
  {{- $blank -}}
{%- endif -%}
"""
)


def conversation_template(spec: Mapping[str, object], *, origin: str = "inline") -> ChatTemplate:
    """An equivalent Jinja template for SGLang's legacy conversation JSON.

    Keys as SGLang reads them: `name`, `system`, `user`, `assistant`, `sep_style`, `stop_str`,
    optional `sep` ("\\n") and `system_message` (""); also `sep2` (default: `sep`) for the
    two-separator styles, which SGLang's loader leaves unset.
    """
    required = ("name", "system", "user", "assistant", "sep_style", "stop_str")
    if missing := [key for key in required if key not in spec]:
        raise TemplateConfigError(f"{origin}: conversation template lacks {', '.join(missing)}")
    sep = spec.get("sep", "\n")
    texts = {
        "system": spec["system"],
        "user": spec["user"],
        "assistant": spec["assistant"],
        "system_message": spec.get("system_message", ""),
        "sep": sep,
        "sep2": spec.get("sep2", sep),
    }
    stop = spec["stop_str"]
    stops = [stop] if isinstance(stop, str) else stop
    if not (
        all(isinstance(value, str) for value in texts.values())
        and isinstance(stops, list)
        and all(isinstance(item, str) for item in stops)
    ):
        raise TemplateConfigError(f"{origin}: conversation template values must be strings")
    style = _SEP_STYLES.get(str(spec["sep_style"]))
    if style is None:
        raise TemplateConfigError(
            f"{origin}: sep_style {spec['sep_style']!r} is not supported "
            f"(supported: {', '.join(_SEP_STYLES)})"
        )
    prefix, message, blank = style
    source = _CONVERSATION.substitute(
        {key: repr(value) for key, value in texts.items()},  # repr: escapes Jinja decodes
        prefix=prefix,
        message=message,
        blank=blank,
    )
    return ChatTemplate(
        source,
        stop=stops,
        origin=f"{origin} ({spec['name']})",
        add_special_tokens=True,
        content_format="string",  # SGLang joins text parts for these, whatever the words in them
    )


# --- resolution ----------------------------------------------------------------------------------


def _pick_named(value: object, origin: str) -> str:
    """A template source from HF's forms: a string, or named templates (picking "default")."""
    if isinstance(value, str):
        return value
    named: Mapping[object, object] = {}
    if isinstance(value, Mapping):
        named = dict(value)
    elif isinstance(value, list):
        named = {
            item.get("name"): item.get("template") for item in value if isinstance(item, Mapping)
        }
    source = named.get("default")
    if isinstance(source, str):
        return source
    names = ", ".join(map(str, named)) or "none"
    raise TemplateConfigError(f"{origin}: no template named 'default' (templates: {names})")


def _from_json(path: Path, origin: str, *, bos_token: str, eos_token: str) -> ChatTemplate:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TemplateConfigError(f"{origin}: not a readable JSON chat template: {exc}") from exc
    if isinstance(data, Mapping) and "chat_template" in data:
        source = _pick_named(data["chat_template"], origin)
    elif isinstance(data, list):
        source = _pick_named(data, origin)
    elif isinstance(data, Mapping) and "sep_style" in data:
        return conversation_template(data, origin=origin)
    else:
        raise TemplateConfigError(
            f"{origin}: a JSON chat template needs a 'chat_template' key (Hugging Face style) "
            "or SGLang's conversation keys (name, system, user, assistant, sep_style, stop_str)"
        )
    return ChatTemplate(source, bos_token=bos_token, eos_token=eos_token, origin=origin)


def resolve_chat_template(
    spec: str | None, *, tokenizer_template: str | None, bos_token: str, eos_token: str
) -> ChatTemplate:
    """The template for `--chat-template spec`, in SGLang's order.

    A built-in name; else a readable file: `.json` as a Hugging Face or SGLang conversation
    template, anything else as Jinja source (SGLang's edits: outer newlines stripped, `\\n`
    unescaped); without a spec, the tokenizer's own template.
    """
    if not spec:
        if tokenizer_template is None:
            raise TemplateConfigError(
                "the model has no chat template; pass --chat-template with a file or one of: "
                + ", ".join(BUILTIN_NAMES)
            )
        return ChatTemplate(
            tokenizer_template, bos_token=bos_token, eos_token=eos_token, origin="the tokenizer"
        )
    if spec in _BUILTINS:
        return builtin_template(spec)
    path = Path(spec)
    origin = f"chat template file {spec}"
    if not path.is_file():
        raise TemplateConfigError(
            f"--chat-template {spec!r} is neither a built-in template ("
            + ", ".join(BUILTIN_NAMES)
            + ") nor a readable file"
        )
    if path.suffix.lower() == ".json":
        return _from_json(path, origin, bos_token=bos_token, eos_token=eos_token)
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateConfigError(f"{origin}: cannot be read: {exc}") from exc
    source = source.strip("\n").replace("\\n", "\n")
    return ChatTemplate(source, bos_token=bos_token, eos_token=eos_token, origin=origin)

"""``POST /v1/chat/completions``: the decoded JSON body → a validated, normalised request.

The top level is strict like completions (unknown fields are refused); messages are lenient:
SDKs send back whole response messages (``refusal: null``, ``annotations: []``, ``audio``),
so keys a role does not use are dropped, not refused. Messages come out as the plain dicts
the chat template renders.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import orjson

from sluice.engine.params import SamplingParams
from sluice.http.errors import ApiError
from sluice.http.protocol.common import (
    read_metadata,
    read_prompt_cache_key,
    read_sampling,
    read_stop,
    read_stream_options,
    read_template_kwargs,
    refuse_unsupported,
)
from sluice.http.protocol.fields import INT64_MAX, Fields, show, type_error
from sluice.http.protocol.structured import read_chat_constraint
from sluice.http.protocol.tools import (
    NONE,
    FunctionTool,
    ToolChoice,
    read_chat_tool_choice,
    read_chat_tools,
)

MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_MESSAGES = 2048
"""Long agent transcripts fit; rendering grows with the count (4096 tiny messages take
~0.4 s to render here) and the context must hold them all anyway."""

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

# Fields of OpenAI's chat request that only OpenAI's hosted service can honour.
_UNSUPPORTED = (
    "audio",
    "prediction",
    "web_search_options",
    "safety_identifier",
    "verbosity",
)
_HARMLESS_SERVICE_TIERS = ("auto", "default")
_TEXT_ONLY = "the model takes text only"


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A chat request, every field validated and defaulted.

    ``max_tokens`` is the client's limit (``max_completion_tokens``, else ``max_tokens``) or
    ``None`` for "up to the context", which the server only knows once the prompt is
    tokenized; so the engine's parameters come from :meth:`sampling_for`, not from
    ``base_sampling``, whose ``max_tokens`` is only a placeholder. ``messages`` are plain
    dicts for the template: ``developer`` already reads ``system``, content is a string or a
    list of ``{"type": "text", "text": …}`` parts, tool-call arguments are parsed objects.
    A structured-output constraint (``response_format``, ``regex``, ``ebnf``,
    ``json_schema``) is ``base_sampling.constraint``.
    """

    model: str
    messages: tuple[Mapping[str, object], ...]
    base_sampling: SamplingParams
    max_tokens: int | None = None
    # The field the client gave ``max_tokens`` in, for the errors that blame it.
    max_tokens_name: str = "max_tokens"
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    prompt_cache_key: str | None = None
    metadata: Mapping[str, str] | None = None
    reasoning_effort: str | None = None
    continue_final_message: bool = False
    chat_template_kwargs: Mapping[str, object] = field(default_factory=dict)
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoice = NONE
    parallel_tool_calls: bool = True

    def sampling_for(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters with the final ``max_tokens``.

        Raises a 400 when ``min_tokens`` cannot fit: with no client limit that is only
        known now.
        """
        if self.base_sampling.min_tokens > max_tokens:
            raise ApiError.bad_request(
                f"min_tokens must be at most max_tokens ({max_tokens}), "
                f"got {self.base_sampling.min_tokens}",
                "min_tokens",
            )
        return replace(self.base_sampling, max_tokens=max_tokens)


def parse_chat_request(body: object) -> ChatRequest:
    """Validate a decoded chat completions body; raise a 400 ``ApiError`` naming the field."""
    fields = Fields.of_body(body)
    model = fields.required_string("model")
    messages = _read_messages(fields)
    _refuse_openai_only(fields)
    max_completion_tokens = fields.integer("max_completion_tokens", minimum=1)
    deprecated_max_tokens = fields.integer("max_tokens", minimum=1)
    max_tokens = (
        max_completion_tokens if max_completion_tokens is not None else deprecated_max_tokens
    )
    n = fields.integer("n", 1, minimum=1, maximum=MAX_N)
    stream = fields.boolean("stream", False)
    stream_options = read_stream_options(fields, stream=stream)
    logprobs = fields.boolean("logprobs", False)
    top_logprobs = fields.integer("top_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise fields.error("top_logprobs", "logprobs must be true when top_logprobs is given")
    top_logprobs = top_logprobs or 0
    tools = read_chat_tools(fields)
    tool_choice = read_chat_tool_choice(fields, tools)
    continue_final_message = fields.boolean("continue_final_message", False)
    if continue_final_message and messages[-1]["role"] != "assistant":
        raise fields.error(
            "continue_final_message",
            f"continue_final_message needs an assistant message last, got {messages[-1]['role']!r}",
        )
    request = ChatRequest(
        model=model,
        messages=messages,
        # Without a client limit min_tokens is checked by sampling_for, against the real one.
        base_sampling=read_sampling(
            fields,
            max_tokens=INT64_MAX if max_tokens is None else max_tokens,
            logprobs=top_logprobs if logprobs else None,
            constraint=read_chat_constraint(fields),
        ),
        max_tokens=max_tokens,
        max_tokens_name="max_tokens" if max_completion_tokens is None else "max_completion_tokens",
        n=n,
        stream=stream,
        include_usage=stream_options.include_usage,
        continuous_usage_stats=stream_options.continuous_usage_stats,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        stop=read_stop(fields),
        no_stop_trim=fields.boolean("no_stop_trim", False),
        skip_special_tokens=fields.boolean("skip_special_tokens", True),
        user=fields.string("user"),
        prompt_cache_key=read_prompt_cache_key(fields),
        metadata=read_metadata(fields),
        reasoning_effort=_read_reasoning_effort(fields),
        continue_final_message=continue_final_message,
        chat_template_kwargs=read_template_kwargs(fields),
        separate_reasoning=fields.boolean("separate_reasoning", True),
        stream_reasoning=fields.boolean("stream_reasoning", True),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=fields.boolean("parallel_tool_calls", True),
    )
    refuse_unsupported(fields)
    fields.finish()
    return request


# ------------------------------------------------------------------------------ messages


def _array(fields: Fields, name: str) -> list[object] | None:
    value = fields.take(name)
    if value is None or isinstance(value, list):
        return value
    raise type_error(fields.param(name), "an array", value)


def _read_messages(fields: Fields) -> tuple[Mapping[str, object], ...]:
    items = _array(fields, "messages")
    if items is None:
        raise fields.error("messages", "Missing required parameter: 'messages'.")
    if not items:
        raise fields.error("messages", "Messages cannot be empty.")
    if len(items) > MAX_MESSAGES:
        raise fields.error(
            "messages", f"messages must have at most {MAX_MESSAGES} entries, got {len(items)}"
        )
    return tuple(_read_message(item, f"messages[{index}]") for index, item in enumerate(items))


def _read_message(item: object, param: str) -> dict[str, object]:
    """One message as the template wants it; keys its role does not use are dropped."""
    if not isinstance(item, dict):
        raise type_error(param, "an object", item)
    message = Fields(item, param)
    role = message.required_string("role")
    if role not in ROLES:
        raise message.error(
            "role", f"{message.param('role')} must be one of {', '.join(ROLES)}, got {show(role)}"
        )
    result: dict[str, object] = {"role": "system" if role == "developer" else role}
    tool_calls = _read_tool_calls(message) if role == "assistant" else None
    # SGLang reads null assistant (and function) content as "", with or without tool calls.
    content = _read_content(message, role, required=role not in ("assistant", "function"))
    result["content"] = "" if content is None else content
    name = message.required_string("name") if role == "function" else message.string("name")
    if name is not None:
        result["name"] = name
    if role == "tool":
        result["tool_call_id"] = message.required_string("tool_call_id")
    if role == "assistant":
        if tool_calls:
            result["tool_calls"] = tool_calls
        reasoning = message.string("reasoning_content")
        if reasoning is not None:
            result["reasoning_content"] = reasoning
    return result


def _read_content(
    message: Fields, role: str, *, required: bool
) -> str | list[dict[str, str]] | None:
    """String content, or its text parts; ``refusal`` parts of assistant messages are text."""
    content = message.take("content")
    if content is None:
        if required:
            raise message.error(
                "content", f"Missing required parameter: '{message.param('content')}'."
            )
        return None
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise type_error(message.param("content"), "a string or an array of content parts", content)
    parts: list[dict[str, str]] = []
    for index, item in enumerate(content):
        param = f"{message.param('content')}[{index}]"
        if not isinstance(item, dict):
            raise type_error(param, "an object", item)
        part = Fields(item, param)
        kind = part.required_string("type")
        if kind == "refusal" and role == "assistant":
            parts.append({"type": "text", "text": part.required_string("refusal")})
        elif kind == "text":
            parts.append({"type": "text", "text": part.required_string("text")})
        elif kind == "refusal":
            raise part.error("type", "refusal content parts are only allowed in assistant messages")
        else:
            raise part.error("type", f"{show(kind)} content parts are not supported: {_TEXT_ONLY}")
    return parts


def _read_tool_calls(message: Fields) -> list[dict[str, object]]:
    """An assistant's earlier tool calls, arguments parsed: HF templates expect a mapping."""
    calls = _array(message, "tool_calls") or []
    result: list[dict[str, object]] = []
    for index, item in enumerate(calls):
        param = f"{message.param('tool_calls')}[{index}]"
        if not isinstance(item, dict):
            raise type_error(param, "an object", item)
        call = Fields(item, param)
        call_id = call.required_string("id")
        kind = call.string("type") or "function"
        if kind != "function":
            raise call.error("type", f"only function tool calls are supported, got {show(kind)}")
        function = call.object("function")
        if function is None:
            raise call.error("function", f"Missing required parameter: '{param}.function'.")
        name = function.required_string("name")
        arguments = function.required_string("arguments")
        try:
            parsed = orjson.loads(arguments)
        except orjson.JSONDecodeError:  # also nesting past orjson's depth limit
            parsed = None
        if not isinstance(parsed, dict):
            raise function.error(
                "arguments", f"{function.param('arguments')} must be a JSON object string"
            )
        result.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}
        )
    return result


# ---------------------------------------------------------------------- top-level fields


def _refuse_openai_only(fields: Fields) -> None:
    """Refuse legacy function calling, storage and OpenAI-hosted features.

    Each is refused only when set: SDKs send ``null`` for fields left out.
    """
    if fields.take("functions") is not None:
        raise fields.error(
            "functions", "'functions' is deprecated and not supported; use 'tools' instead"
        )
    if fields.take("function_call") is not None:
        raise fields.error(
            "function_call",
            "'function_call' is deprecated and not supported; use 'tool_choice' instead",
        )
    if fields.boolean("store", False):
        raise fields.error("store", "store is not supported: chat completions are not stored")
    modalities = _array(fields, "modalities")
    if modalities is not None and modalities != ["text"]:
        raise fields.error("modalities", f"only the text modality is supported: {_TEXT_ONLY}")
    service_tier = fields.string("service_tier")
    if service_tier is not None and service_tier not in _HARMLESS_SERVICE_TIERS:
        raise fields.error("service_tier", f"service_tier {show(service_tier)} is not supported")
    for name in _UNSUPPORTED:
        if fields.take(name) is not None:
            raise fields.error(name, f"{name} is not supported")


def _read_reasoning_effort(fields: Fields) -> str | None:
    effort = fields.string("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise fields.error(
            "reasoning_effort",
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {show(effort)}",
        )
    return effort

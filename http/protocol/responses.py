"""``POST /v1/responses``: the decoded JSON body → a validated, normalised request, and the
conversation (Responses items) → the chat messages the template renders.

The top level is strict (unknown fields are refused, each OpenAI-hosted feature is refused
by name); items are lenient the way SDKs need: a response's own output items fed back
(``status``, ``annotations``, ``logprobs``, ``phase``) are accepted. Items come out in their
stored shape (``ItemResource``: every item has an ``id`` and a ``status``) so that
``input_items`` lists exactly what the model saw.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sluice.engine.grammar import ConstraintError, validate_constraint
from sluice.engine.params import Constraint, SamplingParams
from sluice.http.errors import ApiError
from sluice.http.protocol.common import (
    read_metadata,
    read_prompt_cache_key,
    read_sampling,
    read_stop,
    read_template_kwargs,
    refuse_unsupported,
)
from sluice.http.protocol.fields import INT64_MAX, Fields, show, type_error
from sluice.http.protocol.response_items import Item, read_input
from sluice.http.protocol.structured import _read_json_schema
from sluice.http.protocol.tools import (
    MAX_TOOLS,
    allowed_tools_choice,
    mode_choice,
    named_choice,
    read_function_tool,
    unique_tools,
)
from sluice.pipeline.tool_calling import FunctionTool, ToolChoice

MAX_TOP_LOGPROBS = 20
MIN_MAX_OUTPUT_TOKENS = 16  # OpenAI's minimum
LOGPROBS_INCLUDE = "message.output_text.logprobs"
INCLUDE_VALUES = (
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "message.input_image.image_url",
    "web_search_call.results",
    "web_search_call.action.sources",
    "file_search_call.results",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
BUILTIN_TOOLS = (
    "web_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "web_search_2025_08_26",
    "file_search",
    "code_interpreter",
    "computer",
    "computer_use",
    "computer_use_preview",
    "image_generation",
    "local_shell",
    "shell",
    "mcp",
    "custom",
    "apply_patch",
    "namespace",
    "tool_search",
)
_HARMLESS_SERVICE_TIERS = ("auto", "default")
# OpenAI-hosted features a self-hosted server cannot honour: refused when set.
_UNSUPPORTED = (
    "conversation",
    "prompt",
    "context_management",
    "prompt_cache_retention",
    "prompt_cache_options",
    "safety_identifier",
    "moderation",
)


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A create request, validated. ``input`` holds the items as stored (ids still to be
    given to those without one: the route names them after the response); an
    ``item_reference`` stays a reference until the route resolves it in the store."""

    model: str
    input: tuple[Item, ...]
    base_sampling: SamplingParams
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    include_logprobs: bool = False
    top_logprobs: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    truncation: str = "disabled"
    metadata: Mapping[str, str] = field(default_factory=dict)
    user: str | None = None
    prompt_cache_key: str | None = None
    reasoning_effort: str | None = None
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    tool_choice_echo: object = "auto"
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None
    text_format: Item = field(default_factory=lambda: {"type": "text"})
    constraint: Constraint | None = None
    verbosity: str = "medium"
    service_tier: str = "default"
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    chat_template_kwargs: Mapping[str, object] = field(default_factory=dict)

    def sampling_for(self, max_tokens: int) -> SamplingParams:
        if self.base_sampling.min_tokens > max_tokens:
            raise ApiError.bad_request(
                f"min_tokens must be at most max_output_tokens ({max_tokens}), "
                f"got {self.base_sampling.min_tokens}",
                "min_tokens",
            )
        return replace(self.base_sampling, max_tokens=max_tokens)

    def config(self) -> dict[str, Any]:
        """Every configuration field a ``Response`` echoes, in OpenAI's order."""
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": self.max_tool_calls,
            "model": self.model,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": self.reasoning_effort, "summary": None},
            "service_tier": self.service_tier,
            "store": self.store,
            "temperature": self.temperature,
            "text": {"format": self.text_format, "verbosity": self.verbosity},
            "tool_choice": self.tool_choice_echo,
            "tools": [_tool_echo(t) for t in self.tools],
            "top_logprobs": self.top_logprobs,
            "top_p": self.top_p,
            "truncation": self.truncation,
            "user": self.user,
            "metadata": dict(self.metadata),
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "safety_identifier": None,
            "prompt_cache_key": self.prompt_cache_key,
        }


def parse_responses_request(body: object) -> ResponsesRequest:
    """Validate a decoded create body; raise a 400 ``ApiError`` naming the field."""
    fields = Fields.of_body(body)
    model = fields.required_string("model")
    items = read_input(fields)
    instructions = fields.string("instructions")
    previous = fields.string("previous_response_id")
    if previous is not None:
        check_response_id(previous, "previous_response_id")
    refuse_hosted_features(fields)
    stream = fields.boolean("stream", False)
    _read_stream_options(fields, stream)
    store = fields.boolean("store", True)
    background = fields.boolean("background", False)
    if background and not store:
        raise fields.error("background", "background responses must be stored: set store to true")
    include_logprobs = _read_include(fields)
    top_logprobs = fields.integer("top_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
    if top_logprobs and not include_logprobs:
        raise fields.error("top_logprobs", f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}]")
    max_output_tokens = fields.integer(
        "max_output_tokens", minimum=MIN_MAX_OUTPUT_TOKENS, maximum=INT64_MAX
    )
    truncation = fields.string("truncation") or "disabled"
    if truncation not in ("auto", "disabled"):
        raise fields.error(
            "truncation", f"truncation must be one of auto, disabled, got {show(truncation)}"
        )
    assert isinstance(body, dict)
    raw = body  # the echo shows what was asked, before the greedy cut-off
    temperature = raw.get("temperature")
    top_p = raw.get("top_p")
    presence, frequency = raw.get("presence_penalty"), raw.get("frequency_penalty")
    sampling = read_sampling(
        fields,
        max_tokens=INT64_MAX if max_output_tokens is None else max_output_tokens,
        logprobs=(top_logprobs or 0) if include_logprobs else None,
    )
    tools = _read_tools(fields)
    tool_choice, tool_choice_echo = _read_tool_choice(fields, tools)
    text_format, verbosity, constraint = _read_text(fields, raw)
    effort = _read_reasoning(fields)
    request = ResponsesRequest(
        model=model,
        input=items,
        base_sampling=sampling,
        instructions=instructions,
        previous_response_id=previous,
        max_output_tokens=max_output_tokens,
        store=store,
        background=background,
        stream=stream,
        include_logprobs=include_logprobs,
        top_logprobs=top_logprobs or 0,
        temperature=float(temperature) if temperature is not None else 1.0,
        top_p=float(top_p) if top_p is not None else 1.0,
        presence_penalty=float(presence) if presence is not None else 0.0,
        frequency_penalty=float(frequency) if frequency is not None else 0.0,
        truncation=truncation,
        metadata=read_metadata(fields) or {},
        user=fields.string("user"),
        prompt_cache_key=read_prompt_cache_key(fields),
        reasoning_effort=effort,
        tools=tools,
        tool_choice=tool_choice,
        tool_choice_echo=tool_choice_echo,
        parallel_tool_calls=fields.boolean("parallel_tool_calls", True),
        max_tool_calls=fields.integer("max_tool_calls", minimum=1, maximum=INT64_MAX),
        text_format=text_format,
        constraint=constraint,
        verbosity=verbosity,
        service_tier="default",
        stop=read_stop(fields),
        no_stop_trim=fields.boolean("no_stop_trim", False),
        skip_special_tokens=fields.boolean("skip_special_tokens", True),
        chat_template_kwargs=read_template_kwargs(fields),
    )
    refuse_unsupported(fields)
    fields.finish()
    return request


def refuse_hosted_features(fields: Fields) -> None:
    """What only OpenAI's hosting can honour, refused when set; ``service_tier`` only
    as ``auto`` / ``default``."""
    for name in _UNSUPPORTED:
        if fields.take(name) is not None:
            raise fields.error(name, f"{name} is not supported")
    service_tier = fields.string("service_tier")
    if service_tier is not None and service_tier not in _HARMLESS_SERVICE_TIERS:
        raise fields.error("service_tier", f"service_tier {show(service_tier)} is not supported")


def check_response_id(value: str, param: str) -> None:
    """SGLang's message for an id that cannot be a response's."""
    if not value.startswith("resp_"):
        raise ApiError.bad_request(
            f"Invalid '{param}': {show(value)}. Expected an ID that begins with 'resp'.",
            param,
        )


# ------------------------------------------------------------------ top-level fields


def _read_stream_options(fields: Fields, stream: bool) -> None:
    options = fields.object("stream_options")
    if options is None:
        return
    if not stream:
        raise fields.error("stream_options", "stream_options is only allowed when stream is true")
    if options.boolean("include_obfuscation", False):
        raise options.error("include_obfuscation", "include_obfuscation is not supported")
    options.finish()


def _read_include(fields: Fields) -> bool:
    value = fields.take("include")
    if value is None:
        return False
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise type_error("include", "an array of strings", value)
    for entry in value:
        if entry == LOGPROBS_INCLUDE:
            continue
        if entry in INCLUDE_VALUES:
            raise fields.error("include", f"include {entry!r} is not supported")
        raise fields.error(
            "include", f"include values must be one of {', '.join(INCLUDE_VALUES)}, got "
            f"{show(entry)}"
        )  # fmt: skip
    return LOGPROBS_INCLUDE in value


def _tool_echo(tool: FunctionTool) -> Item:
    return {
        "type": "function",
        "name": tool.name,
        "description": tool.description,
        "parameters": dict(tool.parameters),
        "strict": tool.strict,
    }


def _read_tools(fields: Fields) -> tuple[FunctionTool, ...]:
    """Flat function tools (``{type: "function", name, description, parameters,
    strict}``); a built-in (hosted) tool type is a 400 naming it."""
    value = fields.take("tools")
    if value is None:
        return ()
    if not isinstance(value, list):
        raise type_error("tools", "an array of tools", value)
    if len(value) > MAX_TOOLS:
        raise fields.error(
            "tools", f"tools must have at most {MAX_TOOLS} entries, got {len(value)}"
        )
    tools: list[FunctionTool] = []
    for index, raw in enumerate(value):
        param = f"tools[{index}]"
        if not isinstance(raw, dict):
            raise type_error(param, "an object", raw)
        tool = Fields(raw, param)
        kind = tool.required_string("type")
        if kind == "function":
            tools.append(read_function_tool(tool, index))
            tool.finish()
            continue
        if kind in BUILTIN_TOOLS or kind.startswith(("web_search", "computer")):
            raise tool.error(
                "type",
                f"built-in tool type {kind!r} is not supported: only function tools can be "
                "called on a self-hosted model",
            )
        raise tool.error("type", f"tool type {show(kind)} is not supported")
    return unique_tools(fields, "tools", tools)


def _read_tool_choice(fields: Fields, tools: Sequence[FunctionTool]) -> tuple[ToolChoice, object]:
    """The normalised choice, and what the response echoes."""
    value = fields.take("tool_choice")
    if value is None:
        return mode_choice(fields, "auto", tools), "auto"
    if isinstance(value, str):
        return mode_choice(fields, value, tools), value
    if not isinstance(value, dict):
        raise type_error("tool_choice", "a string or an object", value)
    choice = Fields(value, "tool_choice")
    kind = choice.required_string("type")
    if kind == "function":
        name = choice.required_string("name")
        choice.finish()
        return named_choice(fields, name, tools), {"type": "function", "name": name}
    if kind == "allowed_tools":
        result = allowed_tools_choice(fields, choice, tools, flat=True)
        return result, value
    raise choice.error("type", f"tool_choice of type {show(kind)} is not supported")


def _read_text(fields: Fields, body: dict[str, Any]) -> tuple[Item, str, Constraint | None]:
    """``text.format`` (``text``, ``json_object``, the flattened ``json_schema``) as the
    grammar constraint the engine enforces, and what the response echoes."""
    text = fields.object("text")
    if text is None:
        return {"type": "text"}, "medium", None
    verbosity = text.string("verbosity") or "medium"
    if verbosity != "medium":
        raise text.error(
            "verbosity", f"verbosity {show(verbosity)} is not supported: only 'medium', the default"
        )
    fmt = text.object("format")
    echo: Item = {"type": "text"}
    constraint: Constraint | None = None
    param = text.param("format")
    if fmt is not None:
        kind = fmt.required_string("type")
        if kind == "json_object":
            echo, constraint = {"type": "json_object"}, Constraint("json_object")
        elif kind == "json_schema":
            raw = body["text"]["format"]  # type-checked by the readers above
            param, constraint = _read_json_schema(fmt, name_required=True)
            echo = {"type": "json_schema", "name": raw["name"], "schema": raw["schema"],
                    "strict": bool(raw.get("strict"))}  # fmt: skip
        elif kind != "text":
            raise fmt.error(
                "type", f"text.format.type must be one of text, json_object, json_schema, got "
                f"{show(kind)}"
            )  # fmt: skip
        fmt.finish()
    text.finish()
    if constraint is not None:
        try:
            validate_constraint(constraint)
        except ConstraintError as exc:
            raise ApiError.bad_request(str(exc), param) from exc
    return echo, verbosity, constraint


def _read_reasoning(fields: Fields) -> str | None:
    reasoning = fields.object("reasoning")
    if reasoning is None:
        return None
    effort = reasoning.string("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise reasoning.error(
            "effort", f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}, got "
            f"{show(effort)}"
        )  # fmt: skip
    for name in ("summary", "generate_summary"):
        if reasoning.string(name) is not None:
            raise reasoning.error(
                name, "reasoning summaries are not supported: reasoning comes as reasoning_text"
            )
    for name in ("mode", "context"):
        if reasoning.take(name) is not None:
            raise reasoning.error(name, f"reasoning.{name} is not supported")
    reasoning.finish()
    return effort

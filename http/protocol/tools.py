"""Function tools and ``tool_choice``: the request side of tool calling.

Chat (``{type: "function", function: {…}}``) and Responses (the flat
``{type: "function", name, …}``) both reduce to :class:`FunctionTool` and
:class:`ToolChoice`; what the server does with them lives in
``pipeline/tool_calling.py``. Validation follows SGLang's messages where it has them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema
import orjson

from sluice.http.protocol.fields import Fields, show, type_error
from sluice.pipeline.tool_calling import FunctionTool, ToolChoice

__all__ = [
    "AUTO",
    "MAX_TOOLS",
    "NONE",
    "FunctionTool",
    "ToolChoice",
    "allowed_tools_choice",
    "mode_choice",
    "named_choice",
    "read_chat_tool_choice",
    "read_chat_tools",
    "read_function_tool",
    "unique_tools",
]

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {}}

AUTO = ToolChoice("auto")
NONE = ToolChoice("none")


def read_function_tool(tool: Fields, index: int) -> FunctionTool:
    """The function's fields, read from ``tool`` (chat's ``function`` object, or the flat
    Responses tool itself)."""
    name = tool.required_string("name")
    if not _NAME.fullmatch(name):
        raise tool.error(
            "name",
            f"{tool.param('name')} must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -, "
            f"got {show(name)}",
        )
    description = tool.string("description")
    strict = tool.boolean("strict", False)
    raw = tool.take("parameters")
    if raw is None:
        parameters: Mapping[str, Any] = _EMPTY_PARAMETERS
    elif not isinstance(raw, dict):
        raise type_error(tool.param("parameters"), "a JSON Schema object", raw)
    else:
        parameters = raw
        _check_schema(tool, index, parameters)
    return FunctionTool(name, description, parameters, strict)


def _check_schema(tool: Fields, index: int, schema: Mapping[str, Any]) -> None:
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise tool.error(
            "parameters", f"Tool {index} function has invalid 'parameters' schema: {exc.message}"
        ) from None
    except RecursionError:
        raise tool.error(
            "parameters",
            f"Tool {index} function has invalid 'parameters' schema: too deeply nested "
            "or contains a cycle.",
        ) from None
    try:
        orjson.dumps(schema)
    except orjson.JSONEncodeError:  # integers past 64 bits, nesting past 255 levels
        raise tool.error(
            "parameters", f"Tool {index} function's 'parameters' schema is not representable"
        ) from None


def read_chat_tools(fields: Fields) -> tuple[FunctionTool, ...]:
    """``tools`` of a chat request: function tools only."""
    raw = fields.take("tools")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise type_error(fields.param("tools"), "an array of tools", raw)
    if len(raw) > MAX_TOOLS:
        raise fields.error("tools", f"tools must have at most {MAX_TOOLS} entries, got {len(raw)}")
    tools: list[FunctionTool] = []
    for index, item in enumerate(raw):
        param = f"{fields.param('tools')}[{index}]"
        if not isinstance(item, dict):
            raise type_error(param, "an object", item)
        entry = Fields(item, param)
        kind = entry.required_string("type")
        if kind != "function":
            raise entry.error(
                "type",
                f"{param}.type {show(kind)} is not supported: only 'function' tools are "
                "(custom tools need a grammar per tool, which Sluice does not accept)",
            )
        function = entry.object("function")
        if function is None:
            raise entry.error("function", f"Missing required parameter: '{param}.function'.")
        tools.append(read_function_tool(function, index))
        function.finish()
        entry.finish()
    return unique_tools(fields, "tools", tools)


def unique_tools(
    fields: Fields, name: str, tools: Sequence[FunctionTool]
) -> tuple[FunctionTool, ...]:
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise fields.error(name, f"Tool names must be unique; {tool.name!r} appears twice")
        seen.add(tool.name)
    return tuple(tools)


def read_chat_tool_choice(fields: Fields, tools: Sequence[FunctionTool]) -> ToolChoice:
    """``tool_choice`` of a chat request, checked against ``tools``.

    Forms: ``none`` / ``auto`` / ``required``, ``{type: "function", function: {name}}``
    and ``{type: "allowed_tools", allowed_tools: {mode, tools: [...]}}``.
    """
    raw = fields.take("tool_choice")
    if raw is None:
        return AUTO if tools else NONE
    if isinstance(raw, str):
        return mode_choice(fields, raw, tools)
    if not isinstance(raw, dict):
        raise type_error(fields.param("tool_choice"), "a string or an object", raw)
    choice = Fields(raw, fields.param("tool_choice"))
    kind = choice.required_string("type")
    if kind == "function":
        function = choice.object("function")
        if function is None:
            raise choice.error("function", "Missing required parameter: 'tool_choice.function'.")
        name = function.required_string("name")
        function.finish()
        choice.finish()
        return named_choice(fields, name, tools)
    if kind == "allowed_tools":
        allowed = choice.object("allowed_tools")
        if allowed is None:
            raise choice.error(
                "allowed_tools", "Missing required parameter: 'tool_choice.allowed_tools'."
            )
        result = allowed_tools_choice(fields, allowed, tools, flat=False)
        choice.finish()
        return result
    raise choice.error(
        "type",
        f"tool_choice.type must be 'function' or 'allowed_tools', got {show(kind)}",
    )


def mode_choice(fields: Fields, mode: str, tools: Sequence[FunctionTool]) -> ToolChoice:
    if mode == "none":
        return NONE
    if mode == "auto":
        return AUTO if tools else NONE
    if mode == "required":
        if not tools:
            raise fields.error(
                "tool_choice", "Tools cannot be empty if tool choice is set to required."
            )
        return ToolChoice("required")
    raise fields.error(
        "tool_choice", f"tool_choice must be one of none, auto, required, got {show(mode)}"
    )


def named_choice(fields: Fields, name: str, tools: Sequence[FunctionTool]) -> ToolChoice:
    if not tools:
        raise fields.error(
            "tool_choice", "Tools cannot be empty if tool choice is set to a specific tool."
        )
    if name not in {tool.name for tool in tools}:
        raise fields.error("tool_choice", f"Tool '{name}' not found in tools list.")
    return ToolChoice("required", (name,))


def _allowed_tools(
    fields: Fields,
    allowed: Fields,
    tools: Sequence[FunctionTool],
    function_of: Any,
) -> ToolChoice:
    """``allowed_tools``: a mode and the subset of ``tools`` the model may call.

    ``function_of`` finds the object holding ``name`` in one entry (chat nests it under
    ``function``; Responses does not)."""
    mode = allowed.required_string("mode")
    if mode not in ("auto", "required"):
        raise allowed.error(
            "mode", f"allowed_tools.mode must be auto or required, got {show(mode)}"
        )
    raw = allowed.take("tools")
    if not isinstance(raw, list) or not raw:
        raise allowed.error("tools", "allowed_tools.tools must be a non-empty array of tools")
    names: list[str] = []
    for index, item in enumerate(raw):
        param = f"{allowed.param('tools')}[{index}]"
        if not isinstance(item, dict):
            raise type_error(param, "an object", item)
        entry = Fields(item, param)
        kind = entry.required_string("type")
        if kind != "function":
            raise entry.error("type", f"{param}.type must be 'function', got {show(kind)}")
        holder = function_of(entry)
        if holder is None:
            raise entry.error("function", f"Missing required parameter: '{param}.function'.")
        name = holder.required_string("name")
        if holder is not entry:
            holder.finish()
        entry.finish()
        if name not in {tool.name for tool in tools}:
            raise fields.error("tool_choice", f"Tool '{name}' not found in tools list.")
        names.append(name)
    allowed.finish()
    return ToolChoice(mode, tuple(dict.fromkeys(names)))  # type: ignore[arg-type]


def allowed_tools_choice(
    fields: Fields, allowed: Fields, tools: Sequence[FunctionTool], *, flat: bool
) -> ToolChoice:
    """``allowed_tools`` for a caller: ``flat`` entries carry ``name`` themselves
    (Responses), otherwise under ``function`` (chat)."""
    return _allowed_tools(
        fields, allowed, tools, (lambda entry: entry) if flat else (lambda e: e.object("function"))
    )

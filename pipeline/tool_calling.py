"""Tool calling: how a request's tools reach the prompt, which grammar forces the calls,
and which parser finds them in the output.

The server knows one tool-call format (``--tool-call-parser``, else the chat template's
recognisable markers, else the generic JSON format). Per request:

* ``tool_choice: "none"`` (or no tools): the tools are not shown and nothing is parsed.
* ``required``, a named tool, ``allowed_tools`` with ``required``: the output is forced
  by a JSON-Schema grammar to be ``[{"name": …, "parameters": {…}}, …]`` (one item
  when ``parallel_tool_calls`` is false) over the allowed functions, and parsed as that
  array — SGLang's constraint for these choices, whatever the model's native format.
* ``auto``: the model's own format is parsed; when a tool is ``strict``, a grammar lets
  the model write text or calls in that format, with schema-valid arguments.

A chat template without tool support (the default model's) gets the tools and the
generic format described in a system message, and its history of calls and results as
text, so the model sees the same format the grammar and the parser use.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sluice.engine.params import Constraint
from sluice.pipeline.errors import InvalidRequest

from .chat_template import ChatTemplate
from .tool_formats import TOOL_PARSERS, guess_tool_parser, render_json_tool_calls

GENERIC_PARSER = "json"

# The formats whose calls an ``auto`` grammar can frame: the text before the first call
# ends at a marker (lazily), or the whole output is calls. Others get a 400 for strict
# tools under ``auto`` rather than a grammar that silently does not hold.
_LAZY_TRIGGER = {"hermes": "<tool_call>", "qwen": "<tool_call>", "qwen25": "<tool_call>"}

# Compact JSON from the grammar: a small model otherwise pads with endless whitespace.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


ToolMode = Literal["none", "auto", "required"]


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: Mapping[str, Any]
    strict: bool = False

    def template_entry(self) -> dict[str, Any]:
        """The OpenAI chat shape that Hugging Face chat templates read."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``mode`` with, for a named tool or ``allowed_tools``, the functions it may call."""

    mode: ToolMode
    names: tuple[str, ...] | None = None

    @property
    def named(self) -> str | None:
        """The one function a ``{type: "function"}`` choice forces."""
        return self.names[0] if self.names is not None and len(self.names) == 1 else None


@dataclass(frozen=True, slots=True)
class ToolSupport:
    """The server's tool-call format, decided once from the flag and the template."""

    parser: str
    template_renders_tools: bool

    @classmethod
    def for_template(cls, flag: str | None, template: ChatTemplate) -> ToolSupport:
        renders = "tools" in template.source
        if flag is not None:
            if flag not in TOOL_PARSERS:
                names = ", ".join(sorted(TOOL_PARSERS))
                raise ValueError(f"unknown tool-call parser {flag!r}; choose one of: {names}")
            return cls(flag, renders and flag != GENERIC_PARSER)
        guessed = guess_tool_parser(template.source) if renders else None
        if guessed is None:
            return cls(GENERIC_PARSER, False)
        return cls(guessed, True)


GENERIC_TOOLS = ToolSupport(GENERIC_PARSER, template_renders_tools=False)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What one request's tools change: the prompt, the grammar and the parser."""

    messages: tuple[Mapping[str, object], ...]
    template_tools: tuple[dict[str, Any], ...] | None = None
    constraint: Constraint | None = None
    parser: str | None = None
    schemas: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    max_calls: int | None = None


def plan_tool_calls(
    support: ToolSupport | None,
    tools: Sequence[FunctionTool],
    choice: ToolChoice,
    *,
    parallel: bool,
    messages: Sequence[Mapping[str, object]],
    has_constraint: bool = False,
) -> ToolPlan:
    """The plan for one request; a 400 for combinations that cannot be honoured."""
    generic = support is None or not support.template_renders_tools
    history = tuple(_history_as_text(messages) if generic else messages)
    if choice.mode == "none" or not tools:
        return ToolPlan(history)
    assert support is not None, "tools need a chat template"
    offered = [t for t in tools if choice.names is None or t.name in choice.names]
    schemas = {t.name: t.parameters for t in offered}
    max_calls = None if parallel else 1
    forced = choice.mode == "required"
    strict = any(t.strict for t in offered)
    if (forced or strict) and has_constraint:
        raise InvalidRequest(
            "a response format or grammar cannot be combined with forced or strict tool "
            "calls: both would constrain the same output",
            "tool_choice" if forced else "tools",
        )
    parser = GENERIC_PARSER if forced else support.parser
    constraint = None
    if forced:
        schema = _calls_schema(offered, parallel, enforce_all=True)
        constraint = Constraint("json_schema", json.dumps(schema))
    elif strict:
        constraint = Constraint("lark", _auto_grammar(support.parser, offered, parallel))
    if generic:
        prompt = _generic_prompt(offered, forced=forced, parallel=parallel)
        return ToolPlan(
            _with_system_text(history, prompt), None, constraint, parser, schemas, max_calls
        )
    entries = tuple(t.template_entry() for t in offered)
    return ToolPlan(history, entries, constraint, parser, schemas, max_calls)


# ------------------------------------------------------------------------------ grammars


def _call_schema(tool: FunctionTool, *, arguments_key: str, strict: bool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.name},
            arguments_key: dict(tool.parameters) if strict else {"type": "object"},
        },
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


_DEFINITIONS = ("$defs", "definitions")


def _one_document(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The calls' schemas as one document: ``items[0]`` or their ``anyOf``, with each
    tool's ``$defs`` / ``definitions`` lifted to the top, where its ``#/$defs/…``
    references point once the tool is embedded. A name two tools define differently
    is a 400, as SGLang has it."""
    lifted: dict[str, dict[str, Any]] = {}
    for item in items:
        arguments = next(iter(v for k, v in item["properties"].items() if k != "name"))
        for key in _DEFINITIONS:
            defs = arguments.pop(key, None)
            if not isinstance(defs, dict):
                continue
            into = lifted.setdefault(key, {})
            for name, schema in defs.items():
                if into.setdefault(name, schema) != schema:
                    raise InvalidRequest(
                        f"Tools define {key} {name!r} differently: multiple schemas with "
                        "the same name are not supported",
                        "tools",
                    )
    document: dict[str, Any] = dict(items[0]) if len(items) == 1 else {"anyOf": items}
    document.update(lifted)
    return document


def _calls_schema(
    tools: Sequence[FunctionTool], parallel: bool, *, enforce_all: bool
) -> dict[str, Any]:
    """SGLang's array of calls; every call's arguments valid against its schema when
    ``enforce_all``, else only the strict tools' arguments (the others: any object)."""
    items = [
        _call_schema(t, arguments_key="parameters", strict=enforce_all or t.strict) for t in tools
    ]
    document = _one_document(items)
    lifted = {key: document.pop(key) for key in _DEFINITIONS if key in document}
    schema: dict[str, Any] = {
        "type": "array",
        "items": document,
        "minItems": 1,
        "x-guidance": _COMPACT,
        **lifted,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _auto_grammar(parser: str, tools: Sequence[FunctionTool], parallel: bool) -> str:
    """Text, or calls in ``parser``'s format whose strict tools' arguments are valid."""
    if parser == GENERIC_PARSER:
        calls = _calls_schema(tools, parallel, enforce_all=False)
        # Text that does not open an array, or the array of calls.
        return "\n".join(
            (
                "start: TEXT | calls",
                r"TEXT: /[^\[\s](?s:.*)/",
                f"calls: %json {json.dumps(calls)}",
            )
        )
    trigger = _LAZY_TRIGGER.get(parser)
    if trigger is None:
        supported = ", ".join(sorted({GENERIC_PARSER, *_LAZY_TRIGGER}))
        raise InvalidRequest(
            f"strict tools under tool_choice 'auto' are enforced for the tool-call formats "
            f"{supported}; the server's format is {parser!r}. Use tool_choice 'required' "
            "or a named tool, which are enforced for every format",
            "tools",
        )
    items = [_call_schema(t, arguments_key="arguments", strict=t.strict) for t in tools]
    body = {**_one_document(items), "x-guidance": _COMPACT}
    close = json.dumps(trigger.replace("<", "</", 1))
    more = f"(WS? {json.dumps(trigger)} call)*" if parallel else ""
    return "\n".join(
        (
            f"start: PLAIN | lead call {more} WS?",
            # The text before the first call ends lazily at the marker, so the lexer
            # never has to take back what it read as text.
            f"lead[lazy]: /(?s:.*){_regex_escape(trigger)}/",
            f"call: WS? body WS? {close}",
            f"body: %json {json.dumps(body)}",
            r"WS: /[ \t\n]+/",
            f"PLAIN: /(?s:.*)/ & ~/(?s:.*{_regex_escape(trigger)}.*)/",
        )
    )


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$/-" else c for c in text)


# -------------------------------------------------------------------- the generic prompt


def _generic_prompt(tools: Sequence[FunctionTool], *, forced: bool, parallel: bool) -> str:
    described = "\n".join(
        json.dumps(
            {"name": t.name, "description": t.description or "", "parameters": t.parameters},
            ensure_ascii=False,
        )
        for t in tools
    )
    how = (
        "To call a function, reply with only a JSON array holding the call, and nothing else"
        if not parallel
        else "To call functions, reply with only a JSON array of calls, and nothing else"
    )
    when = (
        "You must call a function."
        if forced
        else "If no function is needed, answer the user in plain text instead."
    )
    return (
        "# Tools\n\nYou can call these functions (each described as JSON):\n"
        f"{described}\n\n{how}:\n"
        '[{"name": "<function name>", "parameters": {<arguments as a JSON object>}}]\n'
        f"{when}"
    )


def _with_system_text(
    messages: tuple[Mapping[str, object], ...], text: str
) -> tuple[Mapping[str, object], ...]:
    """``text`` appended to the leading system message, or as a new one."""
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        content = first.get("content")
        if isinstance(content, list):
            first["content"] = [*content, {"type": "text", "text": "\n\n" + text}]
        else:
            first["content"] = f"{content}\n\n{text}" if content else text
        return (first, *messages[1:])
    return ({"role": "system", "content": text}, *messages)


def _history_as_text(messages: Sequence[Mapping[str, object]]) -> list[Mapping[str, object]]:
    """Earlier calls written into the assistant's text in the generic format, for a
    template that would drop ``tool_calls``."""
    out: list[Mapping[str, object]] = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not isinstance(calls, list) or not calls:
            out.append(message)
            continue
        written = render_json_tool_calls(
            (call["function"]["name"], call["function"]["arguments"]) for call in calls
        )
        rewritten = {k: v for k, v in message.items() if k != "tool_calls"}
        content = message.get("content")
        if isinstance(content, list):
            rewritten["content"] = [*content, {"type": "text", "text": written}]
        else:
            rewritten["content"] = f"{content}\n{written}" if content else written
        out.append(rewritten)
    return out

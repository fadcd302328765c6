"""The tool-call formats of the major model families (``--tool-call-parser NAME``), on
the parsing contract of ``tool_parsers``: which markers open a call, and how one is
read into a name and a JSON object of arguments."""

from __future__ import annotations

import ast
import json
import re
from abc import abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from .tool_parsers import (
    CallUnit,
    ParsedCall,
    Schemas,
    SectionExit,
    ToolParser,
    expect_marker,
    find_marker,
    read_until,
    skip_ws,
)
from .tool_scanners import NeedMore, NotACall, PyScan


class HermesParser(ToolParser):
    """``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, a block per call
    (Hermes, Qwen2.5, Qwen3)."""

    openers = ("<tool_call>",)

    def _unit(self, buf: str) -> CallUnit:
        obj, pos = self._json(buf, skip_ws(buf, len("<tool_call>")))
        end = expect_marker(buf, skip_ws(buf, pos), "</tool_call>")
        return CallUnit(end, (self._call_from(obj),))


class Llama3Parser(ToolParser):
    """``{"name": …, "parameters": {…}}`` as the whole output or after
    ``<|python_tag|>``, several separated by ``;`` (Llama 3.1 / 3.2 JSON calls)."""

    openers = ("<|python_tag|>",)
    start_openers = ("{",)

    def _unit(self, buf: str) -> CallUnit:
        pos = len("<|python_tag|>") if buf.startswith("<|python_tag|>") else 0
        return self._object(buf, skip_ws(buf, pos))

    def _next_in_section(self, buf: str) -> CallUnit | SectionExit:
        pos = skip_ws(buf, 0)
        if pos == len(buf):
            raise NeedMore
        if buf[pos] != ";":
            return SectionExit(0)
        return self._object(buf, skip_ws(buf, pos + 1))

    def _object(self, buf: str, pos: int) -> CallUnit:
        obj, end = self._json(buf, pos)
        # A bare JSON answer is not a call: it must name a function and its arguments.
        return CallUnit(end, (self._call_from(obj, need_arguments=True),), section=True)


_NAME = re.compile(r"[\w.\-]+")


class MistralParser(ToolParser):
    """``[TOOL_CALLS] [{"name": …, "arguments": {…}}, …]`` (v3 / v7 tokenizers) and
    ``[TOOL_CALLS]NAME[ARGS]{…}``, optionally ``NAME[CALL_ID]id[ARGS]{…}`` (v11+)."""

    openers = ("[TOOL_CALLS]",)

    def _unit(self, buf: str) -> CallUnit:
        pos = skip_ws(buf, len("[TOOL_CALLS]"))
        if pos == len(buf):
            raise NeedMore
        if buf[pos] == "[":
            calls, end = self._json(buf, pos, "[")
            if not calls:
                raise NotACall
            return CallUnit(end, tuple(map(self._call_from, calls)))
        name = _NAME.match(buf, pos)
        if name is None:
            raise NotACall
        which, pos = find_marker(buf, name.end(), "[ARGS]", "[CALL_ID]")
        if which:
            pos = read_until(buf, pos, "[ARGS]", forbid="[{ \n")[1]
        arguments, end = self._json(buf, pos)
        return CallUnit(end, (self._call(name[0], arguments),))


class _SectionParser(ToolParser):
    """Calls between call markers, inside an optional section's markers."""

    section_begin: ClassVar[str]
    section_end: ClassVar[str]
    call_begin: ClassVar[str]

    def _unit(self, buf: str) -> CallUnit:
        pos = 0
        if buf.startswith(self.section_begin):
            pos = skip_ws(buf, len(self.section_begin))
        return self._call_at(buf, expect_marker(buf, pos, self.call_begin))

    def _next_in_section(self, buf: str) -> CallUnit | SectionExit:
        which, pos = find_marker(buf, skip_ws(buf, 0), self.call_begin, self.section_end)
        return SectionExit(pos) if which else self._call_at(buf, pos)

    @abstractmethod
    def _call_at(self, buf: str, pos: int) -> CallUnit:
        """The call whose text starts at ``pos`` (after its begin marker)."""


_DS_CALLS_BEGIN, _DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL_BEGIN, _DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
_DS_SEP = "<｜tool▁sep｜>"


class DeepSeekV3Parser(_SectionParser):
    """``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` then the
    arguments in a Markdown json fence, ``<｜tool▁call▁end｜>`` …
    ``<｜tool▁calls▁end｜>`` (DeepSeek V3, R1)."""

    openers = (_DS_CALLS_BEGIN, _DS_CALL_BEGIN)
    section_begin, section_end, call_begin = _DS_CALLS_BEGIN, _DS_CALLS_END, _DS_CALL_BEGIN

    def _call_at(self, buf: str, pos: int) -> CallUnit:
        name, pos = read_until(buf, expect_marker(buf, pos, "function" + _DS_SEP), "\n", forbid="<")
        pos = expect_marker(buf, skip_ws(buf, pos), "```json")
        arguments, pos = self._json(buf, skip_ws(buf, pos))
        pos = expect_marker(buf, skip_ws(buf, pos), "```")
        end = expect_marker(buf, skip_ws(buf, pos), _DS_CALL_END)
        return CallUnit(end, (self._call(name.strip(), arguments),), section=True)


class DeepSeekV31Parser(_SectionParser):
    """DeepSeek V3.1: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>``
    (no ``function`` type, no fence), in the same section markers as V3."""

    openers = (_DS_CALLS_BEGIN, _DS_CALL_BEGIN)
    section_begin, section_end, call_begin = _DS_CALLS_BEGIN, _DS_CALLS_END, _DS_CALL_BEGIN

    def _call_at(self, buf: str, pos: int) -> CallUnit:
        name, pos = read_until(buf, pos, _DS_SEP, forbid="<\n")
        arguments, pos = self._json(buf, skip_ws(buf, pos))
        end = expect_marker(buf, skip_ws(buf, pos), _DS_CALL_END)
        return CallUnit(end, (self._call(name.strip(), arguments),), section=True)


_KIMI_ID = re.compile(r"(?:functions\.)?([\w.\-]+?)(?::[0-9]+)?")


class KimiK2Parser(_SectionParser):
    """``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX``
    ``<|tool_call_argument_begin|>{…}<|tool_call_end|>…<|tool_calls_section_end|>``."""

    openers = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>")
    section_begin, section_end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    call_begin = "<|tool_call_begin|>"

    def _call_at(self, buf: str, pos: int) -> CallUnit:
        ident, pos = read_until(buf, pos, "<|tool_call_argument_begin|>", forbid="<\n")
        name = _KIMI_ID.fullmatch(ident.strip())
        if name is None:
            raise NotACall
        arguments, pos = self._json(buf, skip_ws(buf, pos))
        end = expect_marker(buf, skip_ws(buf, pos), "<|tool_call_end|>")
        return CallUnit(end, (self._call(name[1], arguments),), section=True)


_PY_START, _PY_END = "<|python_start|>", "<|python_end|>"
_PY_HEAD = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_PY_HEAD_PREFIX = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?")


class PythonicParser(ToolParser):
    """``[get_weather(city="Paris"), f()]``: a Python list of calls with literal keyword
    arguments, optionally inside ``<|python_start|>…<|python_end|>`` (Llama 4)."""

    openers = ("[", _PY_START)

    def _unit(self, buf: str) -> CallUnit:
        wrapped = buf.startswith(_PY_START)
        pos = skip_ws(buf, len(_PY_START)) if wrapped else 0
        if not _PY_HEAD.match(buf, pos):
            # "[" opens plenty of plain text: give it up as soon as it is not a call.
            head = _PY_HEAD_PREFIX.match(buf, pos)
            raise NeedMore if pos == len(buf) or (head and head.end() == len(buf)) else NotACall
        end = self._scan(buf, pos, lambda: PyScan(pos))
        return CallUnit(end, self._calls(buf[pos:end]), section=wrapped)

    def _next_in_section(self, buf: str) -> CallUnit | SectionExit:
        return SectionExit(expect_marker(buf, skip_ws(buf, 0), _PY_END))

    def _calls(self, source: str) -> tuple[ParsedCall, ...]:
        try:
            tree = ast.parse(source, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            raise NotACall from exc
        if not isinstance(tree, ast.List) or not tree.elts:
            raise NotACall
        return tuple(self._python_call(node) for node in tree.elts)

    def _python_call(self, node: ast.expr) -> ParsedCall:
        if not isinstance(node, ast.Call) or node.args:
            raise NotACall
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **kwargs
                raise NotACall
            try:
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
                raise NotACall from exc
        return self._call(_dotted(node.func), arguments)


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise NotACall


class Glm45Parser(ToolParser):
    """``<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>…</tool_call>``
    (GLM-4.5 / 4.6): values are bare text, typed by the schema."""

    openers = ("<tool_call>",)

    def _unit(self, buf: str) -> CallUnit:
        start = len("<tool_call>")
        cut = min((i for m in ("\n", "<") if (i := buf.find(m, start)) >= 0), default=-1)
        if cut < 0:
            raise NeedMore
        name, pos = buf[start:cut].strip(), cut
        arguments: dict[str, object] = {}
        while True:
            which, pos = find_marker(buf, skip_ws(buf, pos), "</tool_call>", "<arg_key>")
            if not which:
                return CallUnit(pos, (self._call(name, arguments),))
            key, pos = read_until(buf, pos, "</arg_key>", forbid="<\n")
            pos = expect_marker(buf, skip_ws(buf, pos), "<arg_value>")
            raw, pos = read_until(buf, pos, "</arg_value>")
            arguments[key.strip()] = self._xml_value(name, key.strip(), raw)


class Qwen3CoderParser(ToolParser):
    """``<tool_call>\\n<function=NAME>\\n<parameter=k>\\nv\\n</parameter>\\n</function>``
    ``\\n</tool_call>`` (Qwen3-Coder): values are bare text, typed by the schema."""

    openers = ("<tool_call>",)

    def _unit(self, buf: str) -> CallUnit:
        pos = expect_marker(buf, skip_ws(buf, len("<tool_call>")), "<function=")
        name, pos = read_until(buf, pos, ">", forbid="<\n")
        arguments: dict[str, object] = {}
        while True:
            which, pos = find_marker(buf, skip_ws(buf, pos), "</function>", "<parameter=")
            if not which:
                end = expect_marker(buf, skip_ws(buf, pos), "</tool_call>")
                return CallUnit(end, (self._call(name.strip(), arguments),))
            key, pos = read_until(buf, pos, ">", forbid="<\n")
            raw, pos = read_until(buf, pos, "</parameter>")
            # The template puts the value on lines of its own: those newlines are markup.
            raw = raw.removeprefix("\n").removesuffix("\n")
            arguments[key.strip()] = self._xml_value(name.strip(), key.strip(), raw)


class JsonParser(ToolParser):
    """The generic format, for models without native tool calls: the whole output is
    ``[{"name": …, "parameters": {…}}, …]`` (SGLang's JSON-array constraint for
    ``required`` and named tools; ``"arguments"`` is accepted too). The grammar that
    enforces it belongs to the caller; ``render_json_tool_calls`` writes it.

    The array is a section read item by item, so each call is released once its object
    closes, and the calls before a cut (``max_tokens``) are kept."""

    start_openers = ("[",)

    def _unit(self, buf: str) -> CallUnit:
        return self._item(buf, skip_ws(buf, 1))

    def _next_in_section(self, buf: str) -> CallUnit | SectionExit:
        pos = skip_ws(buf, 0)
        if pos == len(buf):
            raise NeedMore
        if buf[pos] == "]":
            return SectionExit(pos + 1)
        if buf[pos] != ",":
            raise NotACall
        return self._item(buf, skip_ws(buf, pos + 1))

    def _item(self, buf: str, pos: int) -> CallUnit:
        if pos == len(buf):
            raise NeedMore
        if buf[pos] != "{":
            raise NotACall
        obj, end = self._json(buf, pos)
        return CallUnit(end, (self._call_from(obj),), section=True)


def render_json_tool_calls(calls: Iterable[tuple[str, Mapping[str, Any]]]) -> str:
    """Calls (name, arguments) in the generic format, as ``JsonParser`` reads them."""
    return json.dumps(
        [{"name": name, "parameters": dict(arguments)} for name, arguments in calls],
        ensure_ascii=False,
    )


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "deepseekv3": DeepSeekV3Parser,
    "deepseekv31": DeepSeekV31Parser,
    "glm": Glm45Parser,
    "glm45": Glm45Parser,
    "hermes": HermesParser,
    "json": JsonParser,
    "kimi_k2": KimiK2Parser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "qwen": HermesParser,
    "qwen25": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
}


def make_tool_parser(name: str, tools: Schemas | None = None) -> ToolParser:
    """A fresh parser (one per choice) for ``--tool-call-parser NAME``."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        names = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of: {names}")
    return cls(tools)


# In order: the more specific markers first (GLM and Qwen3-Coder also use <tool_call>).
_TEMPLATE_HINTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("tool▁calls▁begin", "```json"), "deepseekv3"),
    (("tool▁calls▁begin",), "deepseekv31"),
    (("<|tool_calls_section_begin|>",), "kimi_k2"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<arg_key>",), "glm45"),
    (("<function=", "<parameter="), "qwen3_coder"),
    (("<tool_call>",), "hermes"),
    (("<|python_start|>",), "pythonic"),
    (("<|python_tag|>",), "llama3"),
)


def guess_tool_parser(chat_template: str) -> str | None:
    """The parser a chat template's tool-call markers point to; None if none does."""
    for markers, name in _TEMPLATE_HINTS:
        if all(marker in chat_template for marker in markers):
            return name
    return None

"""Chat templates: rendering conversations, marking user text (where a template comes
from: ``template_sources``).

Rendering follows `transformers` (a sandboxed Jinja environment with the same globals and
filters), content-format detection follows SGLang. The renderer returns
the prompt as segments so that the caller can tokenize message text with special-token parsing
off: a user who types `<|im_end|>` must not produce the control token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from types import MappingProxyType
from typing import Any, Literal

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

ContentFormat = Literal["string", "openai"]
Segment = tuple[str, bool]
"""(text, is_template_text): False marks text that came from a message."""


class TemplateError(ValueError):
    """A conversation the template cannot render: the client's request is at fault (400)."""


class TemplateConfigError(ValueError):
    """A `--chat-template` value or template source that cannot be used: a start-up error."""


# Unicode noncharacters are reserved for internal use, so they cannot collide with real text;
# input containing them is rejected rather than trusted.
_OPEN, _CLOSE, _CUT = "\ufdd0", "\ufdd1", "\ufdd2"
_MARKER_RE = re.compile(r"([\ufdd0-\ufdd2])")
_NON_ASCII_RE = re.compile(r"[^\x00-\x7f\ufdd0-\ufdd2]")  # markers excepted
_RESERVED_KWARGS = frozenset({"messages", "add_generation_prompt", "tools", "documents"})
_NO_KWARGS: Mapping[str, object] = MappingProxyType({})


# --- the sandboxed environment -------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _ascii_escape(match: re.Match[str]) -> str:
    return json.dumps(match.group())[1:-1]


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' `tojson`: no HTML escaping, json.dumps' options.

    ASCII escaping is applied by hand so that content markers survive it.
    """
    text = json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )
    return _NON_ASCII_RE.sub(_ascii_escape, text) if ensure_ascii else text


class _TemplateDict:
    """`dict` for templates without the class itself, keeping `dict.mro()` out of reach."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _TemplateNamespace(Namespace):
    """`namespace()` refusing underscore names, which could reach interpreter internals."""

    def __init__(self, /, *args: Any, **kwargs: Any) -> None:
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        super().__init__(attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        super().__setitem__(name, value)


class _GenerationTag(Extension):
    """transformers' `{% generation %}` block (its assistant-token mask): rendered unchanged."""

    tags = {"generation"}  # noqa: RUF012 - the type jinja2 declares

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


_ENV = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
)
_ENV.filters["tojson"] = _tojson
_ENV.globals.update(
    raise_exception=_raise_exception,
    strftime_now=_strftime_now,
    dict=_TemplateDict(),
    namespace=_TemplateNamespace,
)


# --- content-format detection (SGLang's detect_jinja_template_content_format) -------------------


def _is_content_of(node: nodes.Node, var: str) -> bool:
    """Whether `node` is `var['content']` or `var.content`, under filters, tests and slices."""
    while True:
        if isinstance(node, nodes.Filter | nodes.Test):
            if node.node is None:
                return False
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            break
    if isinstance(node, nodes.Getitem):
        key = node.arg.value if isinstance(node.arg, nodes.Const) else None
    elif isinstance(node, nodes.Getattr):
        key = node.attr
    else:
        return False
    return key == "content" and isinstance(node.node, nodes.Name) and node.node.name == var


def detect_content_format(source: str) -> ContentFormat:
    """'openai' if the template loops over a message's content parts or handles media."""
    if any(word in source for word in ("image", "audio", "video", "vision")):
        return "openai"
    for loop in _ENV.parse(source).find_all(nodes.For):
        if any(_is_content_of(loop.iter, var) for var in ("message", "msg", "m")):
            return "openai"
    return "string"


# --- rendering -----------------------------------------------------------------------------------


def _check_no_markers(value: object) -> None:
    if isinstance(value, str):
        if _MARKER_RE.search(value):
            raise TemplateError("the request contains a reserved character (U+FDD0 to U+FDD2)")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_no_markers(key)
            _check_no_markers(item)
    elif isinstance(value, list | tuple):
        for item in value:
            _check_no_markers(item)


def _wrap(text: str, closer: str = _CLOSE) -> str:
    """Mark `text` as message text; surrounding whitespace stays outside so `trim` still works."""
    core = text.strip()
    if not core and closer == _CLOSE:
        return text
    lead = text[: len(text) - len(text.lstrip())]
    return lead + _OPEN + core + closer + text[len(lead) + len(core) :]


def _part_text(part: object) -> str:
    if isinstance(part, Mapping) and part.get("type") in ("text", "input_text"):
        text = part.get("text")
        if isinstance(text, str):
            return text
    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
    raise TemplateError(f"content part {kind!r} is not supported: the model takes text only")


def _append(segments: list[Segment], text: str, is_template: bool) -> None:
    """Add a segment, merging neighbours of a kind.

    Whitespace ending template text moves into the message text after it, so that a word keeps
    its leading space when tokenized (" Hello" is one token, " " + "Hello" two).
    """
    if not is_template and segments and segments[-1][1]:
        previous = segments.pop()[0]
        kept = previous.rstrip()
        text = previous[len(kept) :] + text
        if kept:
            segments.append((kept, True))
    if segments and segments[-1][1] == is_template:
        segments[-1] = (segments[-1][0] + text, is_template)
    elif text:
        segments.append((text, is_template))


def _split_segments(marked: str) -> list[Segment]:
    """Split a marked render; only text between an opening and a closing marker is message text.

    A template that cuts message text apart (`content.split(...)`) leaves a lone marker; the text
    around it is then treated as template text, which keeps the prompt exact.
    """
    pieces = _MARKER_RE.split(marked)
    segments: list[Segment] = []
    for k in range(0, len(pieces), 2):
        is_message = 0 < k < len(pieces) - 1 and pieces[k - 1] == _OPEN and pieces[k + 1] != _OPEN
        _append(segments, pieces[k], not is_message)
    return segments


class ChatTemplate:
    """A compiled chat template and the tokens and stop strings that go with it."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str = "",
        eos_token: str = "",
        stop: Sequence[str] = (),
        origin: str = "inline",
        add_special_tokens: bool = False,
        content_format: ContentFormat | None = None,
    ) -> None:
        """`add_special_tokens`: whether the caller should let the tokenizer add its BOS/EOS.
        SGLang does so for its conversation templates only: Jinja templates write their own.

        `content_format`: detected from the source unless given.
        """
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateConfigError(f"{origin}: not a valid chat template: {exc}") from exc
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.stop = tuple(stop)
        self.origin = origin
        self.add_special_tokens = add_special_tokens
        self.content_format = content_format or detect_content_format(source)

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r}, content_format={self.content_format!r})"

    def render(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, object] = _NO_KWARGS,
        reasoning_effort: str | None = None,
    ) -> str:
        """The prompt as one string: the concatenated `render_segments`."""
        segments = self.render_segments(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            template_kwargs=template_kwargs,
            reasoning_effort=reasoning_effort,
        )
        return "".join(text for text, _ in segments)

    def render_segments(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, object] = _NO_KWARGS,
        reasoning_effort: str | None = None,
    ) -> list[Segment]:
        """The prompt as `(text, is_template_text)` segments.

        Message text (string content and text parts) is wrapped in markers before rendering and
        found again by them. `continue_final_message` renders without the generation prompt and
        ends the prompt right after the final assistant message's text, as transformers does.
        Failures of any kind inside the template raise `TemplateError`; if `tools` were given,
        one retry passes them flattened to their `function` objects, as SGLang does.
        """
        _check_no_markers([messages, tools, documents, template_kwargs, reasoning_effort])
        if clash := sorted(_RESERVED_KWARGS & template_kwargs.keys()):
            raise TemplateError(f"chat_template_kwargs may not set {', '.join(clash)}")
        if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
            raise TemplateError("continue_final_message needs an assistant message last")

        last, trail = len(messages) - 1, ""
        prepared: list[dict[str, object]] = []
        for index, message in enumerate(messages):
            item, trail = self._prepare(message, final=continue_final_message and index == last)
            prepared.append(item)

        context: dict[str, object] = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        if reasoning_effort is not None:
            context["reasoning_effort"] = reasoning_effort
        context.update(template_kwargs)
        context.update(
            messages=prepared,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            tools=tools,
            documents=documents,
        )
        try:
            marked = self._render(context)
        except TemplateError:
            if not tools:
                raise
            context["tools"] = [tool.get("function", tool) for tool in tools]
            marked = self._render(context)

        if continue_final_message:
            cut = marked.rfind(_CUT)
            if cut < 0:
                raise TemplateError(
                    "continue_final_message: the chat template does not render the final message"
                )
            kept = trail if marked[cut + 1 :].startswith(trail) else ""
            marked = marked[:cut] + kept + _CLOSE
        return _split_segments(marked)

    def _render(self, context: dict[str, object]) -> str:
        try:
            return self._template.render(context)
        except TemplateError:
            raise
        except Exception as exc:  # a template is a program: any failure is this request's
            raise TemplateError(str(exc) or type(exc).__name__) from exc

    def _prepare(
        self, message: Mapping[str, object], *, final: bool
    ) -> tuple[dict[str, object], str]:
        """A message as SGLang passes it (null content as "", other null keys dropped, text parts
        joined for string templates) with its text wrapped in markers.

        The text to continue (`final`) is closed by the cut marker instead; its trailing
        whitespace is returned, to be kept only where the template keeps it (as transformers).
        """
        prepared = {key: value for key, value in message.items() if value is not None}
        content = message.get("content")
        if content is None or isinstance(content, str):
            texts = [content or ""]
        elif isinstance(content, list | tuple):
            texts = [_part_text(part) for part in content]
        else:
            raise TemplateError("message content must be a string, a list of parts or null")
        as_parts = isinstance(content, list | tuple) and self.content_format == "openai"
        if not as_parts:
            texts = [" ".join(texts)]
        closers = [_CLOSE] * len(texts)
        trail = ""
        if final and texts:
            closers[-1] = _CUT
            trail = texts[-1][len(texts[-1].rstrip()) :] if texts[-1].strip() else ""
        wrapped = [_wrap(text, closer) for text, closer in zip(texts, closers, strict=True)]
        prepared["content"] = (
            [{"type": "text", "text": text} for text in wrapped] if as_parts else wrapped[0]
        )
        return prepared, trail

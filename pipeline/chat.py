"""The chat side of the tokenize stage: messages → template → token ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from sluice.engine.params import SamplingParams
from sluice.pipeline.errors import InvalidRequest

from .chat_template import ChatTemplate, TemplateError
from .reasoning import REASONING_FORMATS
from .template_sources import resolve_chat_template
from .tokenize import encode_segments
from .tool_calling import GENERIC_TOOLS, ToolSupport

# Rendering and tokenizing a long conversation takes milliseconds: off the event loop.
_INLINE_CHARS = 8192
_INLINE_MESSAGES = 64


@dataclass(frozen=True)
class ChatSetup:
    """The chat template, the stops its conversations end with, and how the model's
    tool calls and reasoning are written."""

    template: ChatTemplate
    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    tools: ToolSupport = GENERIC_TOOLS
    reasoning_parser: str | None = None
    # The flags this was made from, as ``for_tokenizer`` takes them (for recordings).
    flags: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def for_tokenizer(
        cls,
        spec: str | None,
        tokenizer: Any,
        *,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> ChatSetup | None:
        """``--chat-template spec`` (or the tokenizer's own); None when the model has none.

        A template stop that is a single special token becomes a stop id: special
        tokens never reach the text, so a stop string could not see them. Unknown parser
        names raise ``ValueError``.
        """
        if reasoning_parser is not None and reasoning_parser not in REASONING_FORMATS:
            names = ", ".join(sorted(REASONING_FORMATS))
            raise ValueError(
                f"unknown reasoning parser {reasoning_parser!r}; choose one of: {names}"
            )
        if spec is None and not getattr(tokenizer, "chat_template", None):
            return None
        template = resolve_chat_template(
            spec,
            tokenizer_template=getattr(tokenizer, "chat_template", None),
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
        )
        decoder = tokenizer.added_tokens_decoder
        by_text = {tok.content: i for i, tok in decoder.items() if tok.special}
        ids = frozenset(by_text[s] for s in template.stop if s in by_text)
        strings = tuple(s for s in template.stop if s not in by_text)
        tools = ToolSupport.for_template(tool_call_parser, template)
        given = {
            "chat_template": spec,
            "tool_call_parser": tool_call_parser,
            "reasoning_parser": reasoning_parser,
        }
        flags = {name: value for name, value in given.items() if value is not None}
        return cls(template, ids, strings, tools, reasoning_parser, flags)

    def with_stop_ids(self, sampling: SamplingParams) -> SamplingParams:
        """The template's end-of-turn tokens end the sequence too."""
        ids = self.stop_token_ids
        return replace(sampling, stop_token_ids=sampling.stop_token_ids | ids) if ids else sampling


def render_prompt_ids(
    setup: ChatSetup,
    tokenizer: Any,
    messages: Sequence[Mapping[str, object]],
    continue_final_message: bool,
    template_kwargs: Mapping[str, object],
    reasoning_effort: str | None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[int, ...]:
    """Render the conversation and tokenize it (synchronously; see ``chat_prompt_ids``)."""
    segments = setup.template.render_segments(
        messages,
        add_generation_prompt=not continue_final_message,
        continue_final_message=continue_final_message,
        tools=tools,
        template_kwargs=template_kwargs,
        reasoning_effort=reasoning_effort,
    )
    return encode_segments(tokenizer, segments, add_bos=setup.template.add_special_tokens)


async def chat_prompt_ids(
    setup: ChatSetup | None,
    tokenizer: Any,
    messages: Sequence[Mapping[str, object]],
    *,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, object] | None = None,
    reasoning_effort: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[int, ...]:
    """The prompt's token ids; a template that raises is a 400 with its message."""
    if setup is None:
        raise InvalidRequest(
            "This model has no chat template: start the server with --chat-template "
            "or use /v1/completions.",
            param="messages",
        )
    args = (setup, tokenizer, messages, continue_final_message, template_kwargs or {},
            reasoning_effort, tools)  # fmt: skip
    try:
        # Long content, or many short messages, costs milliseconds: render off the loop.
        size = sum(len(str(m.get("content") or "")) for m in messages)
        if size > _INLINE_CHARS or len(messages) > _INLINE_MESSAGES:
            return await anyio.to_thread.run_sync(render_prompt_ids, *args)
        return render_prompt_ids(*args)
    except TemplateError as exc:
        raise InvalidRequest(f"Chat template error: {exc}", param="messages") from None

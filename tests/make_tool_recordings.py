"""Write the recorded sessions of the native tool-call and reasoning formats.

The default model speaks none of these formats, so each session's engine is scripted:
the model output a family's model would write is tokenized with the default tokenizer
and fed to the real routes, pipeline and projections a few tokens per step, with the
server flags that family needs (chat template, ``--tool-call-parser``,
``--reasoning-parser``). The server records the session as it records a live one, so
the files replay like any other recording.

    python -P -m tests.make_tool_recordings   # rewrites tests/recordings/tools/
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from sluice.engine.interface import EngineBackend, EngineStats, EventSink
from sluice.engine.loader import load_tokenizer, resolve_model
from sluice.engine.params import SequenceSpec
from sluice.events.recorder import FileRecorder
from sluice.events.types import EngineEvent, PromptProcessed, SequenceFinished, TokenSampled
from sluice.http.output import BufferOutput
from sluice.http.routes import chat
from sluice.http.state import ServerState
from sluice.pipeline.chat import ChatSetup
from sluice.pipeline.runner import PipelineContext
from sluice.pipeline.token_text import TokenTexts

OUT = Path(__file__).parent / "recordings" / "tools"
CREATED = 1767225600
CONTEXT = 8192

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris and in Oslo?"}]


@dataclass(frozen=True)
class Case:
    name: str
    flags: dict[str, str]
    outputs: tuple[str, ...]  # one per choice
    tools: tuple[dict[str, Any], ...] = (WEATHER, ADD)
    step: int = 2  # tokens per engine step
    extra: dict[str, Any] = field(default_factory=dict)


CASES = (
    Case(
        "hermes",
        {"chat_template": "qwen2.5", "tool_call_parser": "hermes"},
        (
            "I'll check both. <tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n'
            "</tool_call>",
        ),
    ),
    Case(
        "llama3",
        {"chat_template": "llama-3", "tool_call_parser": "llama3"},
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        ),
        step=3,
    ),
    Case(
        "mistral",
        {"chat_template": "mistral", "tool_call_parser": "mistral"},
        (
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "add", "arguments": {"a": 2, "b": 3}}]',
        ),
        step=1,
    ),
    Case(
        "deepseekv3",
        {"chat_template": "deepseek-v3", "tool_call_parser": "deepseekv3"},
        (
            "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
            'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
            "<｜tool▁calls▁end｜>",
        ),
    ),
    Case(
        "deepseekv31",
        {"chat_template": "deepseek-v3", "tool_call_parser": "deepseekv31"},
        (
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
            '{"city": "Oslo"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>'
            '{"a": 1, "b": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        ),
    ),
    Case(
        "pythonic",
        {"chat_template": "chatml", "tool_call_parser": "pythonic"},
        ('[get_weather(city="Paris"), add(a=2, b=40)]',),
    ),
    Case(
        "kimi_k2",
        {"chat_template": "chatml", "tool_call_parser": "kimi_k2"},
        (
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
            "<|tool_calls_section_end|>",
        ),
    ),
    Case(
        "glm45",
        {"chat_template": "chatml", "tool_call_parser": "glm45"},
        (
            "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>2</arg_value>\n"
            "<arg_key>b</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        ),
    ),
    Case(
        "qwen3_coder",
        {"chat_template": "chatml", "tool_call_parser": "qwen3_coder"},
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
            "</function>\n</tool_call>",
        ),
    ),
    Case(
        "qwen3-reasoning-then-call",
        {"chat_template": "qwen2.5", "tool_call_parser": "hermes", "reasoning_parser": "qwen3"},
        (
            "<think>\nThe user wants two cities — 東京 is not one.\n</think>\n\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "<think>\nJust answer.\n</think>\n\nI cannot check the weather.",
        ),
        extra={"n": 2},
    ),
    Case(
        "deepseek-r1-reasoning",
        {"chat_template": "deepseek-v3", "reasoning_parser": "deepseek-r1"},
        ("Paris is in France; Oslo in Norway.\n</think>\n\nBoth are cold today.",),
        tools=(),
    ),
    Case(
        "kimi-reasoning",
        {"chat_template": "chatml", "reasoning_parser": "kimi"},
        ("◁think▷Two cities.◁/think▷Sunny in Paris, snow in Oslo.",),
        tools=(),
        step=1,
    ),
    Case(
        "mistral-reasoning-truncated",
        {"chat_template": "mistral", "reasoning_parser": "mistral"},
        ("[THINK]Paris first, then Oslo, then",),
        tools=(),
        extra={"max_tokens": 9},
    ),
)


class ScriptedEngine(EngineBackend):
    """Emits each choice's scripted output a few tokens per step, then EOS."""

    def __init__(self, tokenizer: Any, outputs: Sequence[str], step: int) -> None:
        self.tokenizer = tokenizer
        self.outputs = outputs
        self.step = step
        self.max_context = CONTEXT

    def submit(self, specs: Sequence[SequenceSpec], sink: EventSink) -> None:
        eos = self.tokenizer.eos_token_id
        scripts = []
        for spec in specs:
            ids = self.tokenizer.encode(self.outputs[spec.choice_index], add_special_tokens=False)
            limit = spec.sampling.max_tokens
            scripts.append((spec, ids[:limit] if len(ids) >= limit else [*ids, eos]))
        batches: list[list[EngineEvent]] = [
            [
                PromptProcessed(s.request_id, s.choice_index, 0, len(s.prompt_ids), 0)
                for s, _ in scripts
            ]
        ]
        longest = max(len(ids) for _, ids in scripts)
        for start in range(0, longest, self.step):
            batch: list[EngineEvent] = []
            for spec, ids in scripts:
                part = ids[start : start + self.step]
                for k, token in enumerate(part):
                    batch.append(
                        TokenSampled(spec.request_id, spec.choice_index, 1 + start + k, token)
                    )
                if part and start + len(part) == len(ids):
                    stopped = ids[-1] == eos
                    batch.append(
                        SequenceFinished(
                            spec.request_id,
                            spec.choice_index,
                            1 + len(ids),
                            "stop" if stopped else "length",
                            len(ids),
                            eos if stopped else None,
                        )
                    )
            batches.append(batch)
        loop = asyncio.get_running_loop()
        for batch in batches:
            loop.call_soon(sink, batch)

    def cancel(self, request_id: str, choice_index: int | None = None) -> None:
        pass

    def stats(self) -> EngineStats:
        return EngineStats()

    async def flush_cache(self) -> bool:
        return True


async def record(case: Case, stream: bool, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, case.outputs, case.step)
    pipeline = PipelineContext(engine, tokenizer, TokenTexts(tokenizer), CONTEXT)
    setup = ChatSetup.for_tokenizer(
        case.flags.get("chat_template"),
        tokenizer,
        tool_call_parser=case.flags.get("tool_call_parser"),
        reasoning_parser=case.flags.get("reasoning_parser"),
    )
    state = ServerState(pipeline, "SmolLM2-135M-Instruct", FileRecorder(OUT), setup)
    body: dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "messages": ASK, **case.extra}
    if case.tools:
        body["tools"] = list(case.tools)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    kind = "stream" if stream else "unary"
    request_id = f"chatcmpl-{case.name}-{kind}"
    await chat.run_chat(state, body, BufferOutput(), request_id=request_id, created=CREATED)


def main() -> None:
    tokenizer = load_tokenizer(resolve_model(None).folder)
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.jsonl"):
        old.unlink()
    for case in CASES:
        for stream in (False, True):
            anyio.run(record, case, stream, tokenizer)
    print(f"wrote {len(CASES) * 2} recordings to {OUT}")


if __name__ == "__main__":
    main()

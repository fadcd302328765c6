"""Tool-call parsers: the same content and calls however the text is chunked.

Every case is fed whole, split in two at every position, one char at a time, one UTF-8
byte at a time (through an incremental decoder, so chunk boundaries fall inside
multi-byte characters) and in random pieces; the content, the calls' names and their
parsed arguments must be the same every time, and equal to the expected ones.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

import pytest

from sluice.pipeline.reasoning import make_reasoning_parser
from sluice.pipeline.tool_formats import (
    TOOL_PARSERS,
    guess_tool_parser,
    make_tool_parser,
    render_json_tool_calls,
)
from sluice.pipeline.tool_parsers import (
    ContentText,
    Schemas,
    ToolCallArgs,
    ToolCallStart,
    ToolEvent,
)
from tests.support.chunking import splits

Calls = list[tuple[str, dict[str, Any]]]
Result = tuple[str, Calls]


def normalise(events: Sequence[ToolEvent]) -> Result:
    """Content joined and calls (name, parsed arguments), checking the event protocol."""
    content = ""
    names: list[str] = []
    arguments: list[str] = []
    for event in events:
        if isinstance(event, ContentText):
            assert event.text
            content += event.text
        elif isinstance(event, ToolCallStart):
            assert event.index == len(names), "indexes are 0, 1, … and each name comes once"
            names.append(event.name)
            arguments.append("")
        else:
            assert isinstance(event, ToolCallArgs)
            assert event.index == len(names) - 1, "fragments belong to the latest call"
            arguments[event.index] += event.fragment
    parsed = [json.loads(a) for a in arguments]
    assert all(isinstance(a, dict) for a in parsed)
    return content, list(zip(names, parsed, strict=True))


def run(name: str, chunks: Sequence[str], tools: Schemas | None = None) -> Result:
    parser = make_tool_parser(name, tools)
    events: list[ToolEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    return normalise(events)


MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "llama3": ("<|python_tag|>", '"parameters"'),
    "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
    "deepseekv3": ("tool▁call", "tool▁sep", "```"),
    "deepseekv31": ("tool▁call", "tool▁sep"),
    "kimi_k2": ("<|tool_call", "<|tool_calls"),
    "pythonic": ("[", "<|python_start|>", "<|python_end|>"),
    "glm45": ("<tool_call>", "</tool_call>", "<arg_key>", "<arg_value>"),
    "qwen3_coder": ("<tool_call>", "<function=", "<parameter="),
    "json": ('"parameters"', '"name"'),
}

WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TRICKY: dict[str, Any] = {
    "text": "</tool_call><tool_call>[TOOL_CALLS]<｜tool▁call▁end｜>}]); 'quote\" \\ back",
    "nested": {"list": [1, 2.5, -3e2, True, None, {"deep": []}], "empty": {}},
    "unicode": "東京 🌧️ café",
}
TRICKY_JSON = json.dumps(TRICKY, ensure_ascii=False)
# (parser, output, content, calls); a content of "" with no calls means the output itself.
VALID: list[tuple[str, str, str, Calls]] = [
    # hermes / qwen25
    ("hermes", "Just <b>text</b>, a <tool_call without its bracket.", "", []),
    (
        "hermes",
        "Let me check.\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        "</tool_call>",
        "Let me check.",
        [WEATHER],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": [2]}"}\n</tool_call>\n',
        "",
        [("a", {"x": 1}), ("b", {"y": [2]})],
    ),
    (
        "hermes",
        f'<tool_call>{{"name": "echo", "arguments": {TRICKY_JSON}}}</tool_call>\nDone 🎉',
        "\nDone 🎉",
        [("echo", TRICKY)],
    ),
    ("qwen25", '<tool_call>{"name": "f"}</tool_call>', "", [("f", {})]),
    # llama3
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        "",
        [WEATHER],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "f", "parameters": {"q": "a;b"}}; '
        '{"name": "g", "arguments": ' + TRICKY_JSON + "}",
        "",
        [("f", {"q": "a;b"}), ("g", TRICKY)],
    ),
    ("llama3", 'Use {"name": "x", "parameters": {}} like this.', "", []),
    ("llama3", '{"answer": 42}', "", []),
    (
        "llama3",
        '  {"name": "f", "parameters": {}}\nThat is all.',
        "\nThat is all.",
        [("f", {})],
    ),
    # mistral
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}, "id": "abcDEF123"}, {"name": "echo", "arguments": '
        + TRICKY_JSON
        + "}]",
        "Sure.",
        [WEATHER, ("echo", TRICKY)],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}[TOOL_CALLS]search[ARGS]'
        '{"query": "café \\"best\\"", "filters": {"tags": ["a", "b"], "max": 3}}',
        "",
        [
            ("get_weather", {"city": "Zürich"}),
            ("search", {"query": 'café "best"', "filters": {"tags": ["a", "b"], "max": 3}}),
        ],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Bern"}',
        "",
        [("get_weather", {"city": "Bern"})],
    ),
    ("mistral", "See [1] and [TOOL] or [TOOL_CALL] here.", "", []),
    # deepseekv3
    (
        "deepseekv3",
        "I will look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        'get_weather\n```json\n{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n'
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>echo\n```json\n"
        + TRICKY_JSON
        + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "I will look.",
        [WEATHER, ("echo", TRICKY)],
    ),
    # deepseekv31
    (
        "deepseekv31",
        "Looking 👀<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Paris", "unit": "celsius"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>echo'
        "<｜tool▁sep｜>" + TRICKY_JSON + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Looking 👀",
        [WEATHER, ("echo", TRICKY)],
    ),
    # kimi_k2
    (
        "kimi_k2",
        "Checking.<|tool_calls_section_begin|>\n<|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris", "unit": "celsius"}<|tool_call_end|>\n'
        "<|tool_call_begin|>functions.echo:1<|tool_call_argument_begin|>"
        + TRICKY_JSON
        + "<|tool_call_end|>\n<|tool_calls_section_end|>",
        "Checking.",
        [WEATHER, ("echo", TRICKY)],
    ),
    # pythonic
    (
        "pythonic",
        "Calling: [get_weather(city='Paris', unit=\"celsius\"), "
        "echo(text='a]b\\'s \"q\"', n=[1, (2, 3)], d={'k': None, 'b': True}, s='''x\ny''')]",
        "Calling:",
        [
            WEATHER,
            (
                "echo",
                {"text": 'a]b\'s "q"', "n": [1, [2, 3]], "d": {"k": None, "b": True}, "s": "x\ny"},
            ),
        ],
    ),
    (
        "pythonic",
        '<|python_start|>[search(q="東京 🌧️")]<|python_end|> after',
        " after",
        [("search", {"q": "東京 🌧️"})],
    ),
    ("pythonic", "A [link](http://x.y) and [1, 2] and [f(x)] and [].", "", []),
    # glm45
    (
        "glm45",
        "Let me look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Paris</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n"
        "</tool_call>\n<tool_call>echo\n<arg_key>text</arg_key>\n<arg_value>"
        + TRICKY["text"]
        + "</arg_value>\n<arg_key>nested</arg_key>\n<arg_value>"
        + json.dumps(TRICKY["nested"])
        + "</arg_value>\n<arg_key>unicode</arg_key>\n<arg_value>東京 🌧️ café</arg_value>\n"
        "</tool_call>",
        "Let me look.",
        [WEATHER, ("echo", TRICKY)],
    ),
    ("glm45", "<tool_call>now</tool_call>", "", [("now", {})]),
    # qwen3_coder
    (
        "qwen3_coder",
        "On it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=write>\n<parameter=code>\ndef f():\n    return '</function>'\n"
        "\n</parameter>\n</function>\n</tool_call>",
        "On it.",
        [WEATHER, ("write", {"code": "def f():\n    return '</function>'\n"})],
    ),
    # json
    (
        "json",
        '  [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "echo", "arguments": ' + TRICKY_JSON + "}]\n",
        "",
        [WEATHER, ("echo", TRICKY)],
    ),
    ("json", "Hello [world]", "", []),
    ("json", '[1, {"name": "x"}]', "", []),
]
VALID = [(n, t, c if c or calls else t, calls) for n, t, c, calls in VALID]

# Malformed or cut-off calls come out as the text they were: every char of it.
MALFORMED: list[tuple[str, str, Calls]] = [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {a: 1}}\n</tool_call>', []),
    ("hermes", 'Sure.<tool_call>{"name": "f", "arguments": {}}', []),
    ("hermes", 'Sure.<tool_call>{"name": "f", "argu', []),
    ("hermes", '<tool_call>{"name": 1, "arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', []),
    ("hermes", "<tool_call>", []),
    ("hermes", "<tool_c", []),
    ("llama3", '{"name": "f", "parameters": {"a": }', []),
    ("llama3", '<|python_tag|>{"name": "f", "param', []),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "x"}', []),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {}}', []),
    ("mistral", "[TOOL_CALLS] []", []),
    (
        "deepseekv3",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n{"a": 1}',
        [],
    ),
    ("deepseekv31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{bad}", []),
    (
        "kimi_k2",
        "<|tool_calls_section_begin|><|tool_call_begin|>get weather:0"
        "<|tool_call_argument_begin|>{}<|tool_call_end|>",
        [],
    ),
    ("pythonic", "[f(a=1", []),
    ("pythonic", "[f(a=undefined)] and [g(**kw)]", []),
    ("glm45", "<tool_call>f\nhello<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", []),
    ("glm45", "<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value>", []),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>", []),
    ("json", '[{"name": "f", "parameters": {"a": 1', []),
    ("json", "[]", []),
    # Items are calls as soon as they close: a cut array keeps its complete calls.
    ("json", '[{"name": "f", "parameters": {}}, {"name": "g", "par', [("f", {})]),
    # A valid call, then one cut off: the first stays a call, the rest is text.
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": ',
        [("f", {})],
    ),
    ("llama3", '{"name": "f", "parameters": {}}; {"name": ', [("f", {})]),
    (
        "deepseekv31",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
        "<｜tool▁call▁begin｜>g<｜tool▁sep｜>{",
        [("f", {})],
    ),
]
# The text after the valid leading call, where there is one.
_AFTER_CALL = {
    "hermes": "</tool_call>",
    "llama3": "}}",
    "deepseekv31": "<｜tool▁call▁end｜>",
    "json": "{}}",
}


@pytest.mark.parametrize(("name", "text", "content", "calls"), VALID)
def test_valid_output_at_every_chunking(name: str, text: str, content: str, calls: Calls) -> None:
    for i, chunks in enumerate(splits(text)):
        assert run(name, chunks) == (content, calls), (i, chunks)
    if calls:
        family = "hermes" if name == "qwen25" else name
        assert not any(marker in content for marker in MARKERS[family])


@pytest.mark.parametrize(("name", "text", "calls"), MALFORMED)
def test_malformed_calls_pass_through_as_text(name: str, text: str, calls: Calls) -> None:
    content = text[text.index(_AFTER_CALL[name]) + len(_AFTER_CALL[name]) :] if calls else text
    expected = (content, calls)
    for i, chunks in enumerate(splits(text)):
        assert run(name, chunks) == expected, (i, chunks)


# Pieces of each format, shuffled into mostly broken text.
ATOMS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"a": 1}}', "<tool"),
    "llama3": ("<|python_tag|>", '{"name": "f", "parameters": {"a": 1}}', ";", "<|", "{"),
    "mistral": ("[TOOL_CALLS]", " [", '{"name": "f", "arguments": {}}', "]", "f", "[ARGS]"),
    "deepseekv3": (
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n",
        '{"a": 1}',
        "\n```",
        "<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
    ),
    "deepseekv31": ("<｜tool▁call▁begin｜>", "f<｜tool▁sep｜>", '{"a": 1}', "<｜tool▁call▁end｜>"),
    "kimi_k2": (
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>",
        '{"a": 1}',
        "<|tool_call_end|>",
    ),
    "pythonic": ("[", "]", "f(", ")", "a=1", "'", '"', "'''", "<|python_start|>", "\\"),
    "glm45": ("<tool_call>", "f\n", "<arg_key>k</arg_key>", "<arg_value>", "1", "</arg_value>"),
    "qwen3_coder": ("<tool_call>", "<function=f>", "<parameter=k>", "</parameter>", "</function>"),
    "json": ("[", "]", '{"name": "f", "parameters": {}}', ",", "{", '"'),
}


@pytest.mark.parametrize("name", sorted(ATOMS))
def test_random_fragments_chunk_alike_and_lose_nothing(name: str) -> None:
    rng = random.Random(name)
    atoms = (*ATOMS[name], " ", "\n", "x", "</tool_call>")
    for _ in range(200):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 12)))
        whole = run(name, [text])
        if not whole[1]:
            assert whole[0] == text  # no call: every char is content
        assert run(name, list(text)) == whole, text
        for _ in range(3):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(1, 4))))
            chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            assert run(name, chunks) == whole, chunks


@pytest.mark.parametrize(
    ("name", "before", "call"),
    [
        ("hermes", "Let me check the weather ", '<tool_call>{"name": "f"}</tool_call>'),
        ("mistral", "Sure", '[TOOL_CALLS]f[ARGS]{"a": 1}'),
        ("deepseekv3", "Ok", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"),
        ("kimi_k2", "Ok", "<|tool_calls_section_begin|>"),
        ("llama3", "Plain text", "<|python_tag|>"),
    ],
)
def test_content_is_released_before_the_call_arrives(name: str, before: str, call: str) -> None:
    parser = make_tool_parser(name)
    released = [e for chunk in before for e in parser.feed(chunk)]
    # All of it, but its trailing space: that waits to see whether a call follows.
    assert normalise(released) == (before.rstrip(), [])
    for i in range(1, len(call)):
        assert make_tool_parser(name).feed(before + call[:i]) == [ContentText(before.rstrip())]


def test_a_call_is_released_as_soon_as_it_is_complete() -> None:
    parser = make_tool_parser("hermes")
    assert parser.feed('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call') == []
    assert parser.feed(">") == [ToolCallStart(0, "f"), ToolCallArgs(0, '{"a": 1}')]
    assert parser.finish() == []


def test_arguments_are_serialised_as_sglang_does() -> None:
    parser = make_tool_parser("llama3")
    events = parser.feed('{"name":"f","parameters":{"b":[1,2],"a":"é"}}') + parser.finish()
    assert events[1] == ToolCallArgs(0, '{"b": [1, 2], "a": "é"}')


def test_tools_reject_unknown_functions_and_type_xml_values() -> None:
    tools: Schemas = {
        "lookup": {
            "type": "object",
            "properties": {
                "zip": {"type": "string"},
                "count": {"type": "integer"},
                "tags": {"anyOf": [{"type": "array"}, {"type": "null"}]},
            },
        }
    }
    glm = (
        "<tool_call>lookup\n<arg_key>zip</arg_key><arg_value>12345</arg_value>"
        "<arg_key>count</arg_key><arg_value>7</arg_value>"
        '<arg_key>tags</arg_key><arg_value>["a"]</arg_value>'
        "<arg_key>other</arg_key><arg_value>true</arg_value></tool_call>"
    )
    typed = {"zip": "12345", "count": 7, "tags": ["a"], "other": True}
    assert run("glm45", [glm], tools) == ("", [("lookup", typed)])
    assert run("glm45", [glm]) == ("", [("lookup", {**typed, "zip": 12345})])
    coder = "<tool_call>\n<function=lookup>\n<parameter=zip>\n00123\n</parameter>\n</function>\n"
    coder += "</tool_call>"
    assert run("qwen3_coder", [coder], tools) == ("", [("lookup", {"zip": "00123"})])
    unknown = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    assert run("hermes", [unknown], tools) == (unknown, [])


def test_json_format_round_trips() -> None:
    calls: Calls = [("get_weather", {"city": "Zürich"}), ("noop", {}), ("echo", TRICKY)]
    text = render_json_tool_calls(calls)
    for chunks in splits(text):
        assert run("json", chunks) == ("", calls)


REASONED: list[tuple[str, str, str, str, str, Calls]] = [
    (
        "qwen3",
        "hermes",
        "<think>\nThe user wants the weather: call get_weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        "</tool_call>",
        "The user wants the weather: call get_weather.",
        "",
        [WEATHER],
    ),
    (
        "deepseek-r1",
        "deepseekv3",
        "Need weather.\n</think>\n\nOk.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
        '<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris", "unit": "celsius"}\n```'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Need weather.",
        "Ok.",
        [WEATHER],
    ),
    (
        "kimi",
        "kimi_k2",
        "◁think▷思考中◁/think▷<|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "unit": '
        '"celsius"}<|tool_call_end|><|tool_calls_section_end|>',
        "思考中",
        "",
        [WEATHER],
    ),
]


@pytest.mark.parametrize(("reasoning", "tools", "text", "thought", "content", "calls"), REASONED)
def test_a_call_after_reasoning_is_parsed(
    reasoning: str, tools: str, text: str, thought: str, content: str, calls: Calls
) -> None:
    """The reasoning parser runs first; the tool parser reads its content channel."""
    for chunks in splits(text):
        reasoner, parser = make_reasoning_parser(reasoning), make_tool_parser(tools)
        thinking = ""
        events: list[ToolEvent] = []
        for pieces in [*(reasoner.feed(c) for c in chunks), reasoner.finish()]:
            for channel, piece in pieces:
                if channel == "reasoning":
                    thinking += piece
                else:
                    events += parser.feed(piece)
        events += parser.finish()
        assert (thinking, normalise(events)) == (thought, (content, calls)), chunks


def test_qwen3_tool_call_interrupts_unclosed_reasoning() -> None:
    reasoner, parser = make_reasoning_parser("qwen3"), make_tool_parser("hermes")
    text = '<think>Let me call it.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    pieces = reasoner.feed(text) + reasoner.finish()
    assert pieces[0] == ("reasoning", "Let me call it.")
    events = [e for channel, t in pieces[1:] if channel == "content" for e in parser.feed(t)]
    assert normalise(events + parser.finish()) == ("", [("f", {})])


def test_unknown_parser_lists_the_names() -> None:
    with pytest.raises(ValueError, match="choose one of: deepseekv3, deepseekv31, glm"):
        make_tool_parser("nope")
    assert set(MARKERS) | {"qwen25", "qwen", "glm"} == set(TOOL_PARSERS)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{- '<tool_call>\\n' + tool_call | tojson + '\\n</tool_call>' }}", "hermes"),
        ("<tool_call>{{ name }}\n<arg_key>{{ k }}</arg_key>", "glm45"),
        ("<tool_call>\n<function={{ n }}>\n<parameter={{ k }}>", "qwen3_coder"),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3"),
        ("[TOOL_CALLS]{{ name }}[ARGS]", "mistral"),
        (
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + type + '<｜tool▁sep｜>' + '```json'",
            "deepseekv3",
        ),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>'", "deepseekv31"),
        ("<|tool_calls_section_begin|><|tool_call_begin|>", "kimi_k2"),
        ("<|python_start|>[{{ calls }}]<|python_end|>", "pythonic"),
        ("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}", None),
    ],
)
def test_guess_from_chat_template(template: str, expected: str | None) -> None:
    assert guess_tool_parser(template) == expected

"""The parse-fold stage: lifecycle events in, content / reasoning / tool-call events out,
the same however the engine's steps chunked the text."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from sluice.events.types import (
    REQUEST,
    ChoiceFinished,
    Completed,
    Created,
    Delta,
    InProgress,
    LifecycleEvent,
    TextLogprob,
    ToolCall,
    Usage,
)
from sluice.pipeline.parse_fold import OutputParsing, ParseFoldStage, tool_call_id
from tests.support.chunking import splits

RID = "chatcmpl-test"


def stream(chunks: Sequence[str], *, reason: str = "stop", choice: int = 0) -> list[LifecycleEvent]:
    """What the detokenize stage would send: one delta per chunk (one token each)."""
    events: list[LifecycleEvent] = [InProgress(RID, choice, 1, 5, 0)]
    events += [Delta(RID, choice, 2 + i, text, 1) for i, text in enumerate(chunks)]
    usage = Usage(5, len(chunks))
    events.append(ChoiceFinished(RID, choice, 99, reason, 2, usage))  # type: ignore[arg-type]
    return events


def fold(parsing: OutputParsing, events: list[LifecycleEvent], per_batch: int = 1) -> dict:
    stage = ParseFoldStage(parsing, RID)
    out: list[LifecycleEvent] = []
    for i in range(0, len(events), per_batch):
        out += stage.feed(events[i : i + per_batch])
    calls: dict[int, dict] = {}
    for event in out:
        if isinstance(event, ToolCall):
            if event.name is not None:
                assert event.call_index not in calls and event.arguments == ""
                calls[event.call_index] = {"id": event.call_id, "name": event.name, "arguments": ""}
            else:
                assert event.call_id is None
                calls[event.call_index]["arguments"] += event.arguments
    finish = [e for e in out if isinstance(e, ChoiceFinished)]
    assert len(finish) == 1
    deltas = [e for e in out if isinstance(e, Delta)]
    return {
        "content": "".join(d.text for d in deltas if d.channel == "content"),
        "reasoning": "".join(d.text for d in deltas if d.channel == "reasoning"),
        "calls": [calls[i] for i in sorted(calls)],
        "finish": finish[0],
        "tokens": sum(d.token_count for d in deltas),
    }


QWEN = OutputParsing(reasoning_parser="qwen3", tool_parser="hermes")
TEXT = (
    "<think>I should add 2 and 3 — 東京?</think>\n\nLet me add. "
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "é"}}\n</tool_call>'
)


@pytest.mark.parametrize("chunks", list(splits(TEXT)), ids=lambda c: str(len(c)))
def test_reasoning_then_parallel_calls_at_every_chunking(chunks: list[str]) -> None:
    result = fold(QWEN, stream(chunks))
    assert result["reasoning"] == "I should add 2 and 3 — 東京?"
    assert result["content"] == "Let me add."
    assert [(c["name"], json.loads(c["arguments"])) for c in result["calls"]] == [
        ("add", {"a": 2, "b": 3}),
        ("add", {"a": 1, "b": "é"}),
    ]
    assert [c["id"] for c in result["calls"]] == [tool_call_id(RID, 0, i) for i in (0, 1)]
    finish = result["finish"]
    assert (finish.finish_reason, finish.matched_stop) == ("tool_calls", None)
    # A chunk counts when it was fed inside the block or released reasoning.
    assert 1 <= finish.usage.reasoning_tokens <= len(chunks)
    if chunks == list(TEXT):  # one token a character: the block's body and its end marker
        assert finish.usage.reasoning_tokens == len("I should add 2 and 3 — 東京?</think>")
    assert result["tokens"] <= len(chunks)


def test_call_ids_look_like_sglang_ids_and_differ_per_call() -> None:
    ids = {tool_call_id(RID, c, i) for c in range(3) for i in range(3)}
    assert len(ids) == 9
    assert all(i.startswith("call_") and len(i) == 29 for i in ids)
    assert tool_call_id(RID, 0, 0) == tool_call_id(RID, 0, 0)


def test_reasoning_tokens_are_counted_per_choice_and_summed() -> None:
    stage = ParseFoldStage(OutputParsing(reasoning_parser="deepseek-r1"), RID)
    events = stream(["Think", "ing", "</think>", "Answer"]) + stream(
        ["Hm", "</think>", "Yes"], choice=1
    )
    events.append(Completed(RID, REQUEST, 100, Usage(10, 7)))
    out = stage.feed(events)
    finishes = {e.choice_index: e for e in out if isinstance(e, ChoiceFinished)}
    assert finishes[0].usage.reasoning_tokens == 3  # "Think", "ing", "</think>"
    assert finishes[1].usage.reasoning_tokens == 2
    completed = [e for e in out if isinstance(e, Completed)]
    assert completed[0].usage.reasoning_tokens == 5


def test_a_truncated_reasoning_block_is_flushed_as_reasoning() -> None:
    result = fold(
        OutputParsing(reasoning_parser="qwen3"),
        stream(["<think>", "still go", "ing"], reason="length"),
    )
    assert (result["reasoning"], result["content"]) == ("still going", "")
    assert result["finish"].finish_reason == "length"


def test_an_unfinished_call_comes_out_as_text_and_finish_stays() -> None:
    text = 'Sure <tool_call>{"name": "add", "argu'
    result = fold(OutputParsing(tool_parser="hermes"), stream(list(text)), per_batch=3)
    assert result["content"] == text
    assert result["calls"] == []
    assert result["finish"].finish_reason == "stop"
    assert result["finish"].matched_stop == 2


def test_parallel_calls_off_keeps_only_the_first_call() -> None:
    parsing = OutputParsing(tool_parser="json", max_calls=1)
    text = '[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"x": 1}}]'
    result = fold(parsing, stream([text[:10], text[10:]]))
    assert [c["name"] for c in result["calls"]] == ["a"]


def test_unknown_functions_are_text_when_schemas_are_given() -> None:
    parsing = OutputParsing(tool_parser="json", tool_schemas={"add": {"type": "object"}})
    text = '[{"name": "rm", "parameters": {}}]'
    result = fold(parsing, stream([text]))
    assert (result["content"], result["calls"]) == (text, [])


def test_logprobs_of_held_back_text_ride_on_the_next_delta() -> None:
    lp = TextLogprob("x", -0.5, b"x", None)
    events: list[LifecycleEvent] = [
        Delta(RID, 0, 1, "<thi", 1, (lp,)),
        Delta(RID, 0, 2, "nk>a</think>b", 2, (lp, lp)),
        ChoiceFinished(RID, 0, 3, "stop", 2, Usage(1, 3)),
    ]
    out = ParseFoldStage(OutputParsing(reasoning_parser="qwen3"), RID).feed(events)
    deltas = [e for e in out if isinstance(e, Delta)]
    assert [(d.channel, d.text) for d in deltas] == [("reasoning", "a"), ("content", "b")]
    assert [len(d.logprobs or ()) for d in deltas] == [3, 0]
    assert [d.token_count for d in deltas] == [3, 0]


def test_without_parsers_events_pass_through_untouched() -> None:
    events = [Created(RID, REQUEST, 0, 1, "m"), *stream(["a", "b"])]
    assert ParseFoldStage(OutputParsing(), RID).feed(list(events)) == events
    assert ParseFoldStage(None, RID).feed(list(events)) == events


def test_prompt_deltas_are_not_parsed() -> None:
    events: list[LifecycleEvent] = [
        Delta(RID, 0, 1, "<think>", 1, is_prompt=True),
        *stream(["x"]),
    ]
    out = ParseFoldStage(OutputParsing(reasoning_parser="qwen3"), RID).feed(events)
    assert isinstance(out[0], Delta) and out[0].is_prompt and out[0].text == "<think>"

"""``/v1/responses`` end to end: the pinned ``openai`` SDK against the shared test server
(the real default model). Greedy outputs are exact (the same conversations as the chat
end-to-end tests, through the same template). Every JSON body and every stream event
is validated against OpenAI's spec (``responses_spec``), raw, before the SDK parses it.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import TYPE_CHECKING, Any

import openai
import pytest

from tests.support.e2e_responses import FRANCE, FRANCE_ANSWER, ITALY, ITALY_FOLLOW_UP
from tests.support.greedy_pins import HAIKU_16, PIRATE_ANSWER, PIRATE_SYSTEM
from tests.support.greedy_pins import HAIKU_QUESTION as HAIKU
from tests.support.openapi import validate
from tests.support.responses_spec import check_response, check_stream, parse_sse

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tests.conftest import Server

pytestmark = pytest.mark.model


def create(client: openai.OpenAI, **kwargs: Any) -> tuple[dict[str, Any], Any]:
    """The raw body (validated) and the SDK's parsed ``Response``."""
    raw = client.responses.with_raw_response.create(**kwargs)
    body = check_response(raw.http_response.json())
    return body, raw.parse()


def raw_stream(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    request = urllib.request.Request(
        f"{server.v1}/responses",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = parse_sse(resp.read())
    check_stream(events)
    return events


def count_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> int:
    """The prompt length transformers gives the plain chat messages."""
    conversation: Any = messages
    ids = tokenizer.apply_chat_template(
        conversation, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    return len(ids)


def test_create_with_a_string(
    client: openai.OpenAI, model: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    body, response = create(client, model=model, input=FRANCE, temperature=0)
    assert response.output_text == FRANCE_ANSWER
    assert response.status == "completed" and body["completed_at"] >= body["created_at"]
    [item] = body["output"]
    assert item["type"] == "message" and item["id"].startswith("msg_")
    assert item["status"] == "completed" and item["role"] == "assistant"
    assert item["content"][0]["annotations"] == [] and item["content"][0]["logprobs"] == []
    usage = body["usage"]
    assert usage["input_tokens"] == count_prompt(tokenizer, [{"role": "user", "content": FRANCE}])
    assert usage["output_tokens"] == 8  # 7 tokens and the end of turn
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    # SGLang's names beside OpenAI's (its clients read them), and the SDK keeps them.
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        usage["input_tokens"],
        usage["output_tokens"],
    )
    assert response.usage is not None
    assert response.usage.model_dump()["prompt_tokens"] == usage["input_tokens"]
    assert body["temperature"] == 0 and body["store"] is True and body["background"] is False


def test_create_with_items_and_instructions(
    client: openai.OpenAI, model: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    items: list[Any] = [
        {"role": "user", "content": FRANCE},
        {"type": "message", "role": "assistant", "content": "Arr, it be Paris!"},
        {"role": "user", "content": [{"type": "input_text", "text": ITALY}]},
    ]
    body, response = create(
        client, model=model, input=items, instructions=PIRATE_SYSTEM, temperature=0,
        max_output_tokens=24,
    )  # fmt: skip
    assert response.output_text == PIRATE_ANSWER
    assert body["instructions"] == PIRATE_SYSTEM
    expected = count_prompt(
        tokenizer,
        [
            {"role": "system", "content": PIRATE_SYSTEM},
            {"role": "user", "content": FRANCE},
            {"role": "assistant", "content": "Arr, it be Paris!"},
            {"role": "user", "content": ITALY},
        ],
    )
    assert body["usage"]["input_tokens"] == expected


def test_stream_helper_to_completion(client: openai.OpenAI, model: str, server: Server) -> None:
    with client.responses.stream(model=model, input=FRANCE, temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == FRANCE_ANSWER and final.status == "completed"
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") >= 7  # token by token
    # The same request, raw: every event valid against the spec, the SDK's invariants.
    events = raw_stream(server, {"model": model, "input": FRANCE, "temperature": 0})
    assert [e["type"] for e in events] == kinds
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == FRANCE_ANSWER


def test_continue_with_previous_response_id(
    client: openai.OpenAI, model: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    first, _ = create(client, model=model, input=FRANCE, temperature=0)
    body, response = create(
        client, model=model, input=ITALY, previous_response_id=first["id"], temperature=0,
        max_output_tokens=24,
    )  # fmt: skip
    assert response.output_text == ITALY_FOLLOW_UP
    assert body["previous_response_id"] == first["id"]
    history = [
        {"role": "user", "content": FRANCE},
        {"role": "assistant", "content": FRANCE_ANSWER},
        {"role": "user", "content": ITALY},
    ]
    assert body["usage"]["input_tokens"] == count_prompt(tokenizer, history)
    # Only the new input is this response's input.
    items = list(client.responses.input_items.list(body["id"]))
    assert [item.type for item in items] == ["message"]


def test_retrieve_and_delete(client: openai.OpenAI, model: str, server: Server) -> None:
    body, _ = create(client, model=model, input=FRANCE, temperature=0, max_output_tokens=16)
    raw = client.responses.with_raw_response.retrieve(body["id"])
    assert check_response(raw.http_response.json()) == body
    deleted = client.responses.with_raw_response.delete(body["id"])
    assert deleted.http_response.json() == {"id": body["id"], "object": "response",
                                            "deleted": True}  # fmt: skip
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(body["id"])
    validate("ErrorResponse", caught.value.response.json())
    with pytest.raises(openai.BadRequestError):
        client.responses.retrieve("not-a-response")


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI, model: str) -> None:
    body, response = create(client, model=model, input=HAIKU, temperature=0, max_output_tokens=16)
    assert response.status == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response.output_text == HAIKU_16
    assert body["usage"]["output_tokens"] == 16
    assert body["output"][0]["status"] == "incomplete"


def test_cancel_a_background_response(client: openai.OpenAI, model: str) -> None:
    body, response = create(
        client, model=model, input="Tell me a very long story about the sea.",
        background=True, max_output_tokens=4000, temperature=0,
    )  # fmt: skip
    assert body["status"] == "queued" and body["background"] is True
    deadline = time.monotonic() + 120
    while client.responses.retrieve(response.id).status == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    raw = client.responses.with_raw_response.cancel(response.id)
    cancelled = check_response(raw.http_response.json())
    assert cancelled["status"] == "cancelled"
    retrieved = client.responses.retrieve(response.id)
    assert retrieved.status == "cancelled"
    assert retrieved.usage is None or retrieved.usage.output_tokens < 4000
    # A cancelled response is not generating any more: its text does not grow.
    text = retrieved.output_text
    time.sleep(0.3)
    assert client.responses.retrieve(response.id).output_text == text


def test_background_response_finishes_and_replays(
    client: openai.OpenAI, model: str, server: Server
) -> None:
    _body, response = create(client, model=model, input=FRANCE, background=True, temperature=0)
    deadline = time.monotonic() + 120
    while (current := client.responses.retrieve(response.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert current.status == "completed" and current.output_text == FRANCE_ANSWER
    with urllib.request.urlopen(
        f"{server.v1}/responses/{response.id}?stream=true&starting_after=2", timeout=60
    ) as resp:
        tail = parse_sse(resp.read())
    assert tail[0]["sequence_number"] == 3 and tail[-1]["type"] == "response.completed"
    assert tail[-1]["response"]["output"][0]["content"][0]["text"] == FRANCE_ANSWER


def test_input_items_auto_paging(client: openai.OpenAI, model: str) -> None:
    items: list[Any] = [{"role": "user", "content": f"Say {word}."} for word in
                        ("one", "two", "three", "four", "five")]  # fmt: skip
    body, _ = create(client, model=model, input=items, temperature=0, max_output_tokens=16)
    page = client.responses.input_items.with_raw_response.list(body["id"], limit=2)
    validate("ResponseItemList", page.http_response.json())
    listed = list(client.responses.input_items.list(body["id"], limit=2))
    texts = [item.content[0].text for item in listed]  # type: ignore[union-attr]
    assert texts == ["Say five.", "Say four.", "Say three.", "Say two.", "Say one."]
    ascending = list(client.responses.input_items.list(body["id"], order="asc", limit=3))
    assert [i.id for i in ascending] == [i.id for i in reversed(listed)]


def test_logprobs_when_included(client: openai.OpenAI, model: str) -> None:
    body, _ = create(
        client, model=model, input=FRANCE, temperature=0, top_logprobs=2,
        include=["message.output_text.logprobs"],
    )  # fmt: skip
    part = body["output"][0]["content"][0]
    # As on chat: the end-of-turn token was sampled, so it has a logprob too.
    assert "".join(lp["token"] for lp in part["logprobs"]) == FRANCE_ANSWER + "<|im_end|>"
    assert part["text"] == FRANCE_ANSWER
    assert all(len(lp["top_logprobs"]) >= 2 for lp in part["logprobs"])
    assert all(lp["logprob"] <= 0 for lp in part["logprobs"])


def test_errors(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="x", previous_response_id="resp_unknown")
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=model,
            input=[
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "x", "detail": "auto"}],
                }
            ],
        )
    assert "input_image" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="x", tools=[{"type": "web_search"}])
    assert "web_search" in caught.value.message


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": False,
}
WEATHER_Q = "What is the weather like in Paris today?"


def test_forced_call_then_its_output_leads_to_an_answer(
    client: openai.OpenAI, model: str, server: Server
) -> None:
    first, response = create(
        client, model=model, input=WEATHER_Q, tools=[WEATHER_TOOL], tool_choice="required",
        max_output_tokens=96, temperature=0,
    )  # fmt: skip
    assert first["status"] == "completed"
    calls = [item for item in first["output"] if item["type"] == "function_call"]
    assert calls and all(c["status"] == "completed" for c in calls)
    call = calls[0]
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    # Greedy and grammar-forced: the same call as chat gets (tests/e2e/test_e2e_tools.py).
    assert (call["name"], json.loads(call["arguments"])) == (
        "get_weather", {"city": "Paris", "unit": "celsius"},
    )  # fmt: skip
    assert first["tools"] == [WEATHER_TOOL] and first["tool_choice"] == "required"
    # The same request streamed: function_call_arguments events, valid and in order.
    events = raw_stream(server, {"model": model, "input": WEATHER_Q, "tools": [WEATHER_TOOL],
                                 "tool_choice": "required", "max_output_tokens": 96,
                                 "temperature": 0})  # fmt: skip
    assert "response.function_call_arguments.done" in [e["type"] for e in events]
    assert events[-1]["response"]["output"][0]["arguments"] == call["arguments"]
    # The tool's result, sent back by reference to the stored call: the model answers.
    second, answer = create(
        client, model=model, previous_response_id=response.id, tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": call["call_id"],
                "output": '{"temperature": 18, "sky": "sunny"}'}],
        max_output_tokens=48, temperature=0,
    )  # fmt: skip
    assert second["status"] in ("completed", "incomplete")
    assert answer.output_text or any(i["type"] == "function_call" for i in second["output"])
    items = list(client.responses.input_items.list(second["id"]))
    assert [i.type for i in items] == ["function_call_output"]


def test_stream_helper_with_a_named_tool(client: openai.OpenAI, model: str) -> None:
    with client.responses.stream(
        model=model,
        input=WEATHER_Q,
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=96,
        temperature=0,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed"
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"]


def test_text_format_json_schema_is_enforced(client: openai.OpenAI, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 20}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    body, response = create(
        client, model=model, input=FRANCE, temperature=0, max_output_tokens=48,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                         "strict": True}},
    )  # fmt: skip
    assert body["text"]["format"]["type"] == "json_schema"
    assert set(json.loads(response.output_text)) == {"capital"}

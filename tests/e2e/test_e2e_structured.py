"""Structured outputs end to end: the ``openai`` SDK against the shared server with the
real default model. The grammar decides what the model may say; greedy outputs are
exact (read off the server once and hard-coded), and every one is also checked against
its schema, regex or grammar, so a change of model or prompt still has to satisfy the
constraint. Bodies and chunks are validated against OpenAI's spec as in the other
end-to-end tests."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.support.e2e_chat import (
    bad_request,
    chat,
    chat_stream,
    check_body,
    choice_parts,
    error_message,
    user,
)
from tests.support.e2e_completions import complete, stream

pytestmark = pytest.mark.model

FRANCE = user("What is the capital of France? Answer in JSON.")


class City(BaseModel):
    name: str
    country: str


CITY_JSON = '{"name":"Paris","country":"FRANCE"}'
CITY_SCHEMA = {  # what the SDK's parse() sends for City: no other keys
    "type": "object",
    "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
    "required": ["name", "country"],
    "additionalProperties": False,
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["pilot", "baker", "teacher"]},
        "skills": {"type": "array", "items": {"$ref": "#/$defs/skill"}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "skills"],
    "additionalProperties": False,
    "$defs": {"skill": {"type": "string", "maxLength": 16}},
}
PILOT = user("Describe a pilot as JSON.")
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
YES_NO = 'root ::= "The answer is " ("yes" | "no") "."'


def schema_format(schema: dict[str, Any], name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def content(body: dict[str, Any], index: int = 0) -> str:
    choice = body["choices"][index]
    assert choice["message"]["refusal"] is None
    text = choice["message"]["content"]
    assert isinstance(text, str)
    return text


# ------------------------------------------------------------------------- chat


def test_sdk_parse_returns_the_pydantic_object(client: openai.OpenAI, model: str) -> None:
    raw = client.chat.completions.with_raw_response.parse(
        model=model,
        messages=FRANCE,
        response_format=City,
        temperature=0,
        max_completion_tokens=60,
    )
    check_body(json.loads(raw.text))
    completion = raw.parse()
    message = completion.choices[0].message
    assert message.content == CITY_JSON  # exactly the document: no fences, no prose
    assert message.parsed == City(name="Paris", country="FRANCE")
    assert message.refusal is None
    assert completion.choices[0].finish_reason == "stop"


def test_json_schema_output_validates(client: openai.OpenAI, model: str) -> None:
    body = chat(
        client,
        model=model,
        messages=PILOT,
        response_format=schema_format(PERSON, "person"),
        temperature=0,
        max_completion_tokens=120,
    )
    text = content(body)
    jsonschema.validate(json.loads(text), PERSON)
    assert text == '{"name":"Pilot","age":23,"role":"pilot","skills":[]}'
    assert body["choices"][0]["finish_reason"] == "stop"


def test_json_object_output_is_one_object(client: openai.OpenAI, model: str) -> None:
    body = chat(
        client,
        model=model,
        messages=user("Give the capital of France as a JSON object with one key, city."),
        response_format={"type": "json_object"},
        temperature=0,
        max_completion_tokens=60,
    )
    text = content(body)
    assert isinstance(json.loads(text), dict)
    assert text == '{"city":{"name":"Paris","population":1,"capital":"Paris"}}'
    assert body["choices"][0]["finish_reason"] == "stop"


def test_regex_output_fullmatches(client: openai.OpenAI, model: str) -> None:
    body = chat(
        client,
        model=model,
        messages=user("Give me a phone number."),
        extra_body={"regex": PHONE},
        temperature=0,
        max_completion_tokens=30,
    )
    text = content(body)
    assert re.fullmatch(PHONE, text)
    assert text == "(123) 123-1232"
    # Complete: nothing may follow, so the sequence ends with stop and no stop token.
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["matched_stop"] is None


def test_ebnf_output_is_in_the_language(client: openai.OpenAI, model: str) -> None:
    body = chat(
        client,
        model=model,
        messages=user("Is Paris the capital of France? Answer yes or no."),
        extra_body={"ebnf": YES_NO},
        temperature=0,
        max_completion_tokens=30,
    )
    assert content(body) == "The answer is no."
    assert body["choices"][0]["finish_reason"] == "stop"


def test_n_choices_each_follow_the_grammar(client: openai.OpenAI, model: str) -> None:
    colors = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "shade": {"type": "integer",
                       "minimum": 1, "maximum": 9}},
        "required": ["color", "shade"],
        "additionalProperties": False,
    }  # fmt: skip
    body = chat(
        client,
        model=model,
        messages=user("Name a color and a shade from 1 to 9, as JSON."),
        response_format=schema_format(colors),
        n=2,
        temperature=1.0,
        seed=11,
        max_completion_tokens=40,
    )
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for i in range(2):
        jsonschema.validate(json.loads(content(body, i)), colors)
        assert body["choices"][i]["finish_reason"] == "stop"
    # Each choice has its own matcher (and its own seeded draws).
    assert [content(body, i) for i in range(2)] == [
        '{"color":"red","shade":1}',
        '{"color":"green","shade":1}',
    ]


def test_streamed_constrained_output_equals_the_unary_one(
    client: openai.OpenAI, model: str
) -> None:
    params: dict[str, Any] = {
        "model": model,
        "messages": FRANCE,
        "response_format": schema_format(CITY_SCHEMA, "city"),
        "temperature": 0,
        "max_completion_tokens": 60,
    }
    chunks = chat_stream(client, **params)
    parts = choice_parts(chunks)
    streamed = "".join(p["delta"].get("content") or "" for p in parts)
    assert streamed == CITY_JSON
    assert [p["finish_reason"] for p in parts if p["finish_reason"]] == ["stop"]
    assert content(chat(client, **params)) == streamed


def test_invalid_schema_is_a_400_naming_the_field(client: openai.OpenAI, model: str) -> None:
    error = bad_request(
        client,
        model=model,
        messages=FRANCE,
        response_format=schema_format({"type": "objec"}),
        stream=True,  # still a plain 400, before any generation
    )
    assert error.param == "response_format.json_schema.schema"
    assert error_message(error) == "Invalid JSON schema: Invalid type: objec"


@pytest.mark.parametrize("stream", [False, True])
def test_a_regex_whose_lexer_cannot_run_is_a_400(
    client: openai.OpenAI, model: str, stream: bool
) -> None:
    """It compiles and masks once, but its first token overflows llguidance's lexer: the
    server finds that before anything is generated."""
    error = bad_request(
        client,
        model=model,
        messages=FRANCE,
        extra_body={"regex": "(a{1000}){1000}"},
        stream=stream,
    )
    assert error.param == "regex"
    assert error_message(error) == (
        "Invalid regex: the grammar cannot run: lexer error: too many expressions constructed"
    )


def test_two_constraints_are_a_400(client: openai.OpenAI, model: str) -> None:
    error = bad_request(
        client,
        model=model,
        messages=FRANCE,
        response_format={"type": "json_object"},
        extra_body={"regex": "a+"},
    )
    assert error.param == "regex"
    assert error_message(error) == "Only one of regex, json_schema, or ebnf can be set."


# ------------------------------------------------------------------ completions


def test_completion_with_a_json_schema(client: openai.OpenAI, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    body = complete(
        client,
        model=model,
        prompt="The capital of France as JSON:",
        extra_body={"json_schema": json.dumps(schema)},
        temperature=0,
        max_tokens=30,
    )
    text = body["choices"][0]["text"]
    jsonschema.validate(json.loads(text), schema)
    assert text == '{"city":"Paris"}'
    assert body["choices"][0]["finish_reason"] == "stop"


def test_completion_with_a_regex_streamed(client: openai.OpenAI, model: str) -> None:
    params: dict[str, Any] = {
        "model": model,
        "prompt": "The capital of France is",
        "extra_body": {"regex": r" [A-Z][a-z]+\."},
        "temperature": 0,
        "max_tokens": 10,
    }
    body = complete(client, **params)
    assert body["choices"][0]["text"] == " Paris."
    assert body["choices"][0]["finish_reason"] == "stop"
    chunks = stream(client, **params)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " Paris."

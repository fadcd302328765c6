"""Structured-output fields of chat and completions bodies: what becomes a constraint,
and what is refused (a 400 naming the field, with the compiler's message)."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from aiohttp.test_utils import TestClient, TestServer

from sluice.engine.params import Constraint
from sluice.http.app import create_app
from sluice.http.errors import ApiError
from sluice.http.protocol.chat import parse_chat_request
from sluice.http.protocol.completions import parse_completion_request
from sluice.http.protocol.structured import ONLY_ONE
from tests.support.fake_engine import MODEL, FakeEngine, fake_state

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))
TYPE_3 = "Invalid JSON schema: type must be a string or array of strings"


def chat(**fields: object) -> Constraint | None:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}
    return parse_chat_request(body).base_sampling.constraint


def completion(**fields: object) -> Constraint | None:
    return parse_completion_request({"model": "m", "prompt": "Hi", **fields}).sampling.constraint


def refused(parse: Any, **fields: object) -> ApiError:
    with pytest.raises(ApiError) as raised:
        parse(**fields)
    assert raised.value.status == 400
    assert raised.value.type == "invalid_request_error"
    return raised.value


# ---------------------------------------------------------------------- accepted


def test_no_structured_fields_no_constraint() -> None:
    assert chat() is None
    assert chat(response_format={"type": "text"}) is None
    assert chat(response_format=None, regex=None, ebnf=None, json_schema=None) is None
    assert completion() is None


def test_response_format_json_object() -> None:
    assert chat(response_format={"type": "json_object"}) == Constraint("json_object")


@pytest.mark.parametrize("strict", [True, False, None])
def test_response_format_json_schema(strict: bool | None) -> None:
    spec: dict[str, object] = {"name": "city-info_1", "schema": SCHEMA, "strict": strict}
    got = chat(response_format={"type": "json_schema", "json_schema": spec})
    assert got == Constraint("json_schema", SCHEMA_TEXT)


def test_the_flat_json_schema_form_is_lifted_as_sglang_does() -> None:
    got = chat(response_format={"type": "json_schema", "schema": SCHEMA})
    assert got == Constraint("json_schema", SCHEMA_TEXT)


@pytest.mark.parametrize("parse", [chat, completion])
def test_sglang_extensions(parse: Any) -> None:
    assert parse(regex=r"\d+") == Constraint("regex", r"\d+")
    assert parse(ebnf='root ::= "a"') == Constraint("ebnf", 'root ::= "a"')
    assert parse(json_schema=SCHEMA_TEXT) == Constraint("json_schema", SCHEMA_TEXT)


def test_the_constraint_reaches_the_final_sampling_params() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "regex": "yes|no",
        "temperature": 0,
    }
    sampling = parse_chat_request(body).sampling_for(7)
    assert sampling.constraint == Constraint("regex", "yes|no")
    assert sampling.max_tokens == 7 and sampling.greedy


# ---------------------------------------------------------------------- refused


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"regex": "a", "ebnf": 'root ::= "a"'},
            "ebnf",
            ONLY_ONE,
        ),
        (
            {"regex": "a", "json_schema": "{}"},
            "json_schema",
            ONLY_ONE,
        ),
        (
            {"response_format": {"type": "json_object"}, "regex": "a"},
            "regex",
            ONLY_ONE,
        ),
        (
            {"regex": "(a"},
            "regex",
            'Invalid regex: at 1(8): invalid regex "(a" (in regex): regex parse error:\n'
            "    (a\n    ^\nerror: unclosed group\n   1 | start: /(a/\n              ^",
        ),
        ({"ebnf": 'rule ::= "a"'}, "ebnf", "Invalid EBNF grammar: No 'root' rule found"),
        ({"json_schema": '{"type": 3}'}, "json_schema", TYPE_3),
        (
            {"json_schema": "{"},
            "json_schema",
            "Invalid JSON schema: not valid JSON: Expecting property name enclosed in double "
            "quotes: line 1 column 2 (char 1)",
        ),
        ({"regex": ["a"]}, "regex", "'regex' must be a string, got array"),
        ({"json_schema": SCHEMA}, "json_schema", "'json_schema' must be a string, got object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "response_format.json_schema.schema is required for json_schema response format "
            "request.",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objec"}},
                }
            },
            "response_format.json_schema.schema",
            "Invalid JSON schema: Invalid type: objec",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"properties": {"a": {"$ref": "#/$defs/b"}}},
                    },
                }
            },
            "response_format.json_schema.schema",
            "Invalid JSON schema: Pointer '/$defs/b' does not exist",
        ),
        (
            {"response_format": {"type": "json_schema", "schema": {"type": "objec"}}},
            "response_format.schema",
            "Invalid JSON schema: Invalid type: objec",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema.name",
            "Missing required parameter: 'response_format.json_schema.name'.",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a b", "schema": SCHEMA},
                }
            },
            "response_format.json_schema.name",
            "response_format.json_schema.name must be 1 to 64 characters of a-z, A-Z, 0-9, _ "
            "and -, got 'a b'",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"},
                }
            },
            "response_format.json_schema.strict",
            "'response_format.json_schema.strict' must be a boolean, got string",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "description": "A city"},
                }
            },
            "response_format.json_schema.description",
            "response_format.json_schema.description is not supported: describe the format in "
            "the messages",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": [SCHEMA]},
                }
            },
            "response_format.json_schema.schema",
            "'response_format.json_schema.schema' must be an object, got array",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "extra": 1},
                }
            },
            "response_format.json_schema.extra",
            "Unrecognized request argument supplied: response_format.json_schema.extra",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "Missing required parameter: 'response_format.json_schema'.",
        ),
        (
            {"response_format": {"type": "json_object", "json_schema": {}}},
            "response_format.json_schema",
            "Unrecognized request argument supplied: response_format.json_schema",
        ),
        (
            {"response_format": {"type": "xml"}},
            "response_format.type",
            "response_format.type must be one of text, json_object, json_schema, got 'xml'",
        ),
    ],
)
def test_refused_in_chat(fields: dict[str, object], param: str, message: str) -> None:
    error = refused(chat, **fields)
    assert (error.param, error.message) == (param, message)


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"ebnf": 'root ::= "a"', "json_schema": "{}"}, "json_schema", ONLY_ONE),
        ({"regex": "[z-a]"}, "regex", None),
        ({"response_format": {"type": "json_object"}}, "response_format", None),
    ],
)
def test_refused_in_completions(fields: dict[str, object], param: str, message: str | None) -> None:
    error = refused(completion, **fields)
    assert error.param == param
    if message is not None:
        assert error.message == message


def test_sources_are_bounded() -> None:
    error = refused(chat, regex="a" * (256 << 10 | 1))
    assert error.param == "regex"
    assert error.message == "regex must be at most 262144 characters long, got 262145"
    big = {"type": "object", "description": "x" * (256 << 10)}
    spec = {"name": "x", "schema": big}
    error = refused(chat, response_format={"type": "json_schema", "json_schema": spec})
    assert error.param == "response_format.json_schema.schema"
    assert chat(regex="a" * (256 << 10)) == Constraint("regex", "a" * (256 << 10))


def test_the_http_error_names_the_field_before_generation(tokenizer: Any) -> None:
    engine = FakeEngine(tokens=tokenizer.encode(" la"))

    async def go() -> tuple[int, dict[str, Any]]:
        client = TestClient(TestServer(create_app(fake_state(tokenizer, engine))))
        await client.start_server()
        try:
            resp = await client.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "Hi"}],
                    "stream": True,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"type": "objec"}},
                    },
                },
            )
            return resp.status, await resp.json()
        finally:
            await client.close()

    status, body = anyio.run(go)
    assert status == 400
    assert body == {
        "error": {
            "message": "Invalid JSON schema: Invalid type: objec",
            "type": "invalid_request_error",
            "param": "response_format.json_schema.schema",
            "code": None,
        }
    }
    assert engine.submitted == 0

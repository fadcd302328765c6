"""Schemathesis against the running server, from OpenAI's published OpenAPI spec.

The spec is trimmed at test time to the operations Sluice serves and the components they
reference (the whole file is 3 MB and describes a hundred operations). Each operation gets
a bounded, seeded run of generated requests, checked for "no server error" and "the
response conforms to the schema". Generated bodies are steered, not filtered: the model is
the served one (any other is a plain 400) and token counts are clamped so that the real
model's work stays small.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from jsonschema import Draft202012Validator
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.core.result import Ok, Result
from schemathesis.errors import InvalidSchema
from schemathesis.schemas import APIOperation
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.conftest import Server
from tests.support.openapi import load_spec

pytestmark = pytest.mark.model

OPERATIONS = {
    "/models": ("get",),
    "/models/{model}": ("get",),
    "/completions": ("post",),
    "/chat/completions": ("post",),
}
Operation = APIOperation[Any, Any, Any, Any]
Case = schemathesis.Case[Operation]
ERROR = "#/components/schemas/ErrorResponse"
EXAMPLES_PER_OPERATION = 30
MAX_TOKENS = 2
MAX_CHOICES = 2


def _refs(node: Any) -> Iterator[str]:
    """Every ``$ref`` under ``node``."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str):
                yield ref
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


# Streams, with the schema of their chunks. The spec documents chat's stream with the schema
# of one chunk, which OpenAPI (and schemathesis) read as the schema of the event object
# ({"data": ..., "event": ...}), and completions' stream not at all, though its text says the
# chunks share the response's shape. Either way the chunk is the JSON in each event's data.
# A completions chunk is the response's shape but for ``finish_reason``, which is null until
# the choice's last chunk, as in chat chunks and in OpenAI's own completions streams.
COMPLETION_CHUNK = "CompletionStreamChunk"
STREAMS = {
    "/chat/completions": "#/components/schemas/CreateChatCompletionStreamResponse",
    "/completions": f"#/components/schemas/{COMPLETION_CHUNK}",
}


def completion_chunk_schema(spec: dict[str, Any]) -> dict[str, Any]:
    """``CreateCompletionResponse`` with a nullable ``finish_reason``."""
    chunk = copy.deepcopy(spec["components"]["schemas"]["CreateCompletionResponse"])
    choice = chunk["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
    return chunk


def sse_event(chunk: str) -> dict[str, Any]:
    """An event whose data is a chunk, a mid-stream error, or OpenAI's final ``[DONE]``."""

    def json_of(ref: str) -> dict[str, Any]:
        return {"contentMediaType": "application/json", "contentSchema": {"$ref": ref}}

    data = {"anyOf": [{"const": "[DONE]"}, json_of(chunk), json_of(ERROR)]}
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def trimmed_spec(base_url: str) -> dict[str, Any]:
    """The operations Sluice serves, the components they reach, and ``base_url`` as server.

    Built from the project's reading of the spec (``tests/support/openapi.py``), where the 3.0
    ``nullable`` the spec still uses is translated to JSON Schema.
    """
    spec = load_spec()  # cached and shared: read, never changed
    schemas = {**spec["components"]["schemas"], COMPLETION_CHUNK: completion_chunk_schema(spec)}
    paths = copy.deepcopy(
        {path: {m: spec["paths"][path][m] for m in methods} for path, methods in OPERATIONS.items()}
    )
    for path, chunk in STREAMS.items():
        paths[path]["post"]["responses"]["200"]["content"]["text/event-stream"] = {
            "schema": sse_event(chunk)
        }
    components: dict[str, dict[str, Any]] = {}
    pending = list(_refs(paths))
    while pending:
        ref = pending.pop()
        _, _, kind, name = ref.split("/", 3)  # "#/components/<kind>/<name>"
        if name in components.setdefault(kind, {}):
            continue
        target = schemas[name] if kind == "schemas" else spec["components"][kind][name]
        components[kind][name] = target
        pending.extend(_refs(target))
    return {
        "openapi": spec["openapi"],
        "info": spec["info"],
        "servers": [{"url": base_url}],
        "paths": paths,
        "components": components,
    }


def declared_fields(spec: dict[str, Any], schema: dict[str, Any]) -> frozenset[str]:
    """The property names a request schema declares, through ``$ref`` and ``allOf``."""
    if "$ref" in schema:
        _, _, kind, name = schema["$ref"].split("/", 3)
        return declared_fields(spec, spec["components"][kind][name])
    names = frozenset(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        names |= declared_fields(spec, part)
    return names


def coin(generated: object) -> bool:
    """Heads or tails, decided by the generated value: the same every run."""
    return zlib.crc32(repr(generated).encode()) % 2 == 1


def steer(case: Case, server: Server, declared: frozenset[str]) -> None:
    """The served model, at most ``MAX_TOKENS`` tokens for at most ``MAX_CHOICES`` choices.

    Values the spec allows but Sluice refuses (non-positive counts, unsupported fields,
    a null prompt) are mostly left alone: they must be 400s, which "no server error" covers.
    """
    if case.path_parameters and "model" in case.path_parameters:
        # Half of the generated ids stay (a 404 for any id, slashes and all), half are ours.
        if coin(case.path_parameters):
            case.path_parameters["model"] = server.model
        return
    body = case.body
    if not isinstance(body, dict):
        return
    heads = coin(body)
    # The spec does not forbid undeclared fields, but OpenAI (and Sluice) refuse them.
    for key in body.keys() - declared:
        del body[key]
    body["model"] = server.model
    # Generated prompts are mostly unusable (null, negative token ids): half become one.
    if "prompt" in body and heads:
        body["prompt"] = "Hello"
    # Few generated bodies stream; half of them should, for the event schema to be checked.
    if coin((body, "stream")):
        body["stream"] = True
    limits = {"max_tokens": MAX_TOKENS, "max_completion_tokens": MAX_TOKENS}
    limits |= {"n": MAX_CHOICES, "best_of": MAX_CHOICES}
    for key, limit in limits.items():
        value = body.get(key)
        # Integral floats (``3738.0``) count as integers on the server, so clamp them too.
        if isinstance(value, int | float) and not isinstance(value, bool) and value > limit:
            body[key] = limit
    # Without a limit chat generates up to the context, and completions 16 tokens.
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens" if "prompt" in body else "max_completion_tokens"] = MAX_TOKENS


def fuzz(
    operation: Operation, server: Server, declared: frozenset[str], failures: list[str]
) -> dict[int, int]:
    """Run one operation's examples; return how many responses had each status."""
    statuses: dict[int, int] = {}

    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        derandomize=True,
        database=None,
        deadline=None,
        # No shrinking: each step is a request to the model; the first example is shown.
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy())
    def run(case: Case) -> None:
        steer(case, server, declared)
        try:
            response = case.call_and_validate(
                checks=[not_a_server_error, response_schema_conformance], timeout=120
            )
        except (Failure, FailureGroup) as failure:
            failures.append(f"{case.as_curl_command()}\n{failure}")
            return
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    run()
    return statuses


def operation(result: Result[Operation, InvalidSchema]) -> Operation:
    """An operation schemathesis could read, or its reading error raised."""
    if isinstance(result, Ok):
        return result.ok()
    raise result.err()


def test_openai_spec_against_the_server(server: Server) -> None:
    spec = trimmed_spec(server.v1)
    schema = schemathesis.openapi.from_dict(spec)
    schema.config.update(base_url=server.v1)
    operations = [operation(result) for result in schema.get_all_operations()]
    assert sorted(op.label for op in operations) == [
        "GET /models",
        "GET /models/{model}",
        "POST /chat/completions",
        "POST /completions",
    ]
    failures: list[str] = []
    statuses = {}
    for op in operations:
        request = spec["paths"][op.path][op.method.lower()].get("requestBody")
        body_schema = request["content"]["application/json"]["schema"] if request else {}
        declared = declared_fields(spec, body_schema)
        statuses[op.label] = fuzz(op, server, declared, failures)
    print("statuses by operation:", statuses)  # shown with -s: how far generation got
    assert not failures, "\n\n".join(failures[:5])
    # The steering must let some requests through, or the conformance check saw nothing.
    for label, seen in statuses.items():
        assert seen.get(200, 0) > 0, f"{label}: no 200 among {seen}"


def test_completion_chunks_may_leave_finish_reason_null_until_the_last() -> None:
    spec = load_spec()
    chunk_ref = STREAMS["/completions"]
    root = {
        "$ref": chunk_ref,
        "components": {
            "schemas": {
                **spec["components"]["schemas"],
                COMPLETION_CHUNK: completion_chunk_schema(spec),
            }
        },
    }
    check = Draft202012Validator(root)

    def chunk(finish_reason: object) -> dict[str, Any]:
        choice = {"index": 0, "text": "a", "logprobs": None, "finish_reason": finish_reason}
        return {
            "id": "c",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [choice],
        }

    assert check.is_valid(chunk(None)) and check.is_valid(chunk("length"))
    assert not check.is_valid(chunk("done"))
    # The unary response keeps the spec's non-null finish_reason.
    response = spec["components"]["schemas"]["CreateCompletionResponse"]
    unary = response["properties"]["choices"]["items"]["properties"]["finish_reason"]
    assert set(unary["enum"]) == {"stop", "length", "content_filter"}

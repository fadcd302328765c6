"""Structured outputs: the request fields that constrain the output to a grammar.

Chat's ``response_format`` (``text``, ``json_object``, ``json_schema``) and SGLang's
extensions ``regex``, ``ebnf`` and ``json_schema`` (a schema as a JSON string), on
chat and completions, become one :class:`~sluice.engine.params.Constraint` that the
engine enforces with a token mask. At most one may be given (SGLang's rule and
message). Each is compiled here, before anything is generated: a schema, regex or
grammar the compiler refuses is a 400 naming the field, with the compiler's message.
"""

from __future__ import annotations

import re

import orjson

from sluice.engine.grammar import ConstraintError, validate_constraint
from sluice.engine.params import Constraint, ConstraintKind
from sluice.http.errors import ApiError
from sluice.http.protocol.fields import Fields, show, type_error

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
ONLY_ONE = "Only one of regex, json_schema, or ebnf can be set."
MAX_CONSTRAINT_CHARS = 256 << 10
"""A schema (as compact JSON), regex or grammar: compiled ones are cached (256 of
them, per cache), so their size is bounded; real schemas are a few KiB."""
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


CHAT_FIELDS = ("response_format", "regex", "ebnf", "json_schema")
COMPLETION_FIELDS = ("regex", "ebnf", "json_schema")


def constraint_field(body: object, names: tuple[str, ...] = CHAT_FIELDS) -> str:
    """Which of ``names`` gave a validated body's constraint (at most one may: see
    ``_one``), for the errors found once it is compiled against the vocabulary."""
    given = body if isinstance(body, dict) else {}
    return next((name for name in names if given.get(name) is not None), names[0])


def read_chat_constraint(fields: Fields) -> Constraint | None:
    """``response_format``, ``regex``, ``ebnf`` and ``json_schema`` of a chat request."""
    found = [(param, c) for param, c in _read_response_format(fields) if c is not None]
    found += _read_extensions(fields)
    return _one(found)


def read_completion_constraint(fields: Fields) -> Constraint | None:
    """``regex``, ``ebnf`` and ``json_schema`` of a completions request."""
    return _one(_read_extensions(fields))


def _one(found: list[tuple[str, Constraint]]) -> Constraint | None:
    if len(found) > 1:
        raise ApiError.bad_request(ONLY_ONE, found[1][0])
    if not found:
        return None
    param, constraint = found[0]
    if len(constraint.source) > MAX_CONSTRAINT_CHARS:
        raise ApiError.bad_request(
            f"{param} must be at most {MAX_CONSTRAINT_CHARS} characters long, "
            f"got {len(constraint.source)}",
            param,
        )
    try:
        validate_constraint(constraint)
    except ConstraintError as exc:
        raise ApiError.bad_request(str(exc), param) from exc
    return constraint


def _read_extensions(fields: Fields) -> list[tuple[str, Constraint]]:
    found = []
    kinds: tuple[tuple[str, ConstraintKind], ...] = (
        ("regex", "regex"),
        ("ebnf", "ebnf"),
        ("json_schema", "json_schema"),
    )
    for name, kind in kinds:
        source = fields.string(name)
        if source is not None:
            found.append((fields.param(name), Constraint(kind, source)))
    return found


def _read_response_format(fields: Fields) -> list[tuple[str, Constraint | None]]:
    response_format = fields.object("response_format")
    if response_format is None:
        return []
    kind = response_format.required_string("type")
    constraint: Constraint | None = None
    param = response_format.param("json_schema")
    if kind == "json_object":
        constraint = Constraint("json_object")
        param = fields.param("response_format")
    elif kind == "json_schema":
        nested = response_format.object("json_schema")
        if nested is None and "schema" in _keys(fields, "response_format"):
            # SGLang lifts the flat form {type: json_schema, schema: {...}}.
            nested = response_format
        elif nested is None:
            raise response_format.error("json_schema", f"Missing required parameter: '{param}'.")
        param, constraint = _read_json_schema(nested, name_required=nested is not response_format)
        if nested is not response_format:
            nested.finish()
    elif kind != "text":
        raise response_format.error(
            "type",
            f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got {show(kind)}",
        )
    response_format.finish()
    return [(param, constraint)]


def _keys(fields: Fields, name: str) -> set[str]:
    value = fields.take(name)
    return set(value) if isinstance(value, dict) else set()


def _read_json_schema(spec: Fields, *, name_required: bool) -> tuple[str, Constraint]:
    """``{name, schema, strict, description}``: the schema is always enforced exactly
    (``strict: false`` gets the same guarantee as ``true``)."""
    name = spec.required_string("name") if name_required else spec.string("name")
    if name is not None and not _NAME.fullmatch(name):
        raise spec.error(
            "name",
            f"{spec.param('name')} must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -, "
            f"got {show(name)}",
        )
    spec.boolean("strict", False)
    if spec.string("description"):
        # OpenAI shows it to the model; Sluice has no place in the prompt for it.
        raise spec.error(
            "description",
            f"{spec.param('description')} is not supported: describe the format in the messages",
        )
    schema = spec.take("schema")
    param = spec.param("schema")
    if schema is None:
        raise spec.error("schema", f"{param} is required for json_schema response format request.")
    if not isinstance(schema, dict):
        raise type_error(param, "an object", schema)
    try:
        source = orjson.dumps(schema).decode()
    except orjson.JSONEncodeError as exc:  # integers past 64 bits, nesting past 255 levels
        raise spec.error("schema", f"{param} cannot be encoded as JSON: {exc}") from exc
    return param, Constraint("json_schema", source)

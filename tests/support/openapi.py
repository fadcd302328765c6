"""Check response bodies against OpenAI's published OpenAPI spec (a test helper, not a test).

The spec (``openai-openapi.yaml``, ~3 MB) takes over a second to parse even with
libyaml, so the parsed document is cached as JSON under the repository's git-ignored
``build/`` folder, keyed by the spec file's sha256: a changed spec is simply re-parsed.

The spec says OpenAPI 3.1 but still marks ~100 schemas with the 3.0 keyword
``nullable: true``, which JSON Schema ignores. Those schemas are rewritten to also
accept ``null``, or valid responses (e.g. ``finish_reason: null`` in stream chunks)
would fail. ``discriminator`` and ``format`` are annotations only, which is fine.
The 3.0 idiom ``allOf: [{$ref}, {nullable: true}]`` (only in the Assistants API)
stays non-nullable.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import date
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from referencing import Registry
from referencing.jsonschema import DRAFT202012

SPEC_ENV = "SLUICE_OPENAPI_SPEC"
_SPEC_URI = "urn:sluice:openai-openapi"
CACHE_DIR = Path(__file__).resolve().parents[2] / "build"
# Values under these keys are data (examples, literals, vendor metadata), not schemas.
_DATA_KEYS = frozenset({"example", "examples", "default", "const", "enum"})
# Maps from names to schemas.
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "dependentSchemas", "schemas"})
_MAX_MESSAGE = 300


def spec_path() -> Path:
    """The spec file: ``$SLUICE_OPENAPI_SPEC`` or ``shared/reference`` beside the repository."""
    override = os.environ.get(SPEC_ENV)
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[3] / "shared/reference/openai-openapi.yaml"


@cache
def load_spec() -> dict[str, Any]:
    """The whole spec as plain JSON data, with ``nullable`` translated to JSON Schema."""
    raw = spec_path().read_bytes()
    cached = CACHE_DIR / f"openai-openapi-{hashlib.sha256(raw).hexdigest()}.json"
    try:
        text = cached.read_text(encoding="utf-8")
    except FileNotFoundError:
        # YAML turns unquoted dates into ``date`` objects; JSON has only their text.
        text = json.dumps(yaml.load(raw, Loader=yaml.CSafeLoader), default=_iso_date)
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        partial.write_text(text, encoding="utf-8")
        partial.replace(cached)  # atomic: concurrent test processes never read half a file
    spec: dict[str, Any] = _translate_nullable(json.loads(text))
    return spec


def _iso_date(value: object) -> str:
    if isinstance(value, date):
        return value.isoformat()
    raise TypeError(f"unexpected {type(value).__name__} in the OpenAPI spec")


def _translate_nullable(node: Any, *, names: bool = False) -> Any:
    """Rewrite every ``{..., nullable: true}`` schema as ``anyOf: [{...}, {type: null}]``.

    ``anyOf`` rather than adding ``"null"`` to ``type``: many such schemas also carry an
    ``enum`` that lists no ``null``. ``names`` marks a map from names to schemas
    (``properties``), whose keys are not keywords even when spelt ``default`` or ``enum``.
    """
    if isinstance(node, list):
        return [_translate_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    if names:
        return {key: _translate_nullable(value) for key, value in node.items()}
    out = {
        key: (
            value
            if key in _DATA_KEYS or key.startswith("x-")
            else _translate_nullable(value, names=key in _NAME_MAPS)
        )
        for key, value in node.items()
        if not (key == "nullable" and isinstance(value, bool))
    }
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


@cache
def _registry() -> Registry[Any]:
    registry: Registry[Any] = Registry().with_resource(
        _SPEC_URI, DRAFT202012.create_resource(load_spec())
    )
    return registry


@cache
def validator(schema_name: str) -> Draft202012Validator:
    """A validator for ``components.schemas[schema_name]`` that resolves the spec's ``$ref``s."""
    if schema_name not in load_spec()["components"]["schemas"]:
        raise KeyError(f"no schema {schema_name!r} in {spec_path()}")
    pointer = schema_name.replace("~", "~0").replace("/", "~1")
    return Draft202012Validator(
        {"$ref": f"{_SPEC_URI}#/components/schemas/{pointer}"}, registry=_registry()
    )


def validate(schema_name: str, instance: object) -> None:
    """Raise ``AssertionError`` listing every way ``instance`` breaks the named schema."""
    errors = sorted(validator(schema_name).iter_errors(instance), key=lambda e: e.json_path)
    if not errors:
        return
    lines = [f"{len(errors)} error(s) against components.schemas.{schema_name}:"]
    for error in errors:
        lines.append(f"  {error.json_path}: {_shorten(error.message)}")
        if error.context:  # anyOf/oneOf: the branch that got deepest into the instance
            closest = max(error.context, key=lambda e: len(e.absolute_path))
            lines.append(f"    closest branch: {closest.json_path}: {_shorten(closest.message)}")
    raise AssertionError("\n".join(lines))


def _shorten(message: str) -> str:
    return message if len(message) <= _MAX_MESSAGE else message[: _MAX_MESSAGE - 3] + "..."

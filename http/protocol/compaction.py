"""``POST /v1/responses/compact``: its body, validated (OpenAI's
``CompactResponseMethodPublicBody``)."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.http.protocol.common import read_prompt_cache_key
from sluice.http.protocol.fields import Fields
from sluice.http.protocol.response_items import Item, read_input
from sluice.http.protocol.responses import check_response_id, refuse_hosted_features


@dataclass(frozen=True, slots=True)
class CompactRequest:
    model: str
    input: tuple[Item, ...]
    previous_response_id: str | None
    instructions: str | None
    prompt_cache_key: str | None = None


def parse_compact_request(body: object) -> CompactRequest:
    """The body as a request, or a 400 naming the field; there must be something to
    compact (``input``, ``previous_response_id`` or both)."""
    fields = Fields.of_body(body)
    model = fields.required_string("model")
    items = read_input(fields, required=False)
    previous = fields.string("previous_response_id")
    if previous is not None:
        check_response_id(previous, "previous_response_id")
    elif not items:
        raise fields.error("input", "Nothing to compact: give input, previous_response_id or both.")
    instructions = fields.string("instructions")
    prompt_cache_key = read_prompt_cache_key(fields)
    refuse_hosted_features(fields)
    fields.finish()
    return CompactRequest(model, items, previous, instructions, prompt_cache_key)

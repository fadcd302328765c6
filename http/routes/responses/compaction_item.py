"""The ``encrypted_content`` of a compaction item: what Sluice needs to resume a
compacted conversation, sealed so that only a server holding the store's key accepts
it back.

``sluice1.<payload>.<tag>``: the payload is base64url JSON (the served model's name
and the model's summary of the turns it replaces); the tag is HMAC-SHA256 over
``sluice1.<payload>`` with the store's ``compaction`` secret, so every front end on a
shared store accepts what any of them made, and nothing else. It is signed, not
encrypted: the summary is the model's own words about the client's conversation, and
whoever holds the item may decode them; what it cannot do is change them unnoticed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Sequence

import orjson

from sluice.http.errors import ApiError
from sluice.http.protocol.response_items import Item

PREFIX = "sluice1."
SECRET_NAME = "compaction"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _tag(key: bytes, signed: str) -> str:
    return _b64(hmac.new(key, signed.encode(), hashlib.sha256).digest())


def seal(key: bytes, model: str, summary: str) -> str:
    payload = _b64(orjson.dumps({"model": model, "summary": summary}))
    signed = PREFIX + payload
    return f"{signed}.{_tag(key, signed)}"


def unseal(key: bytes, model: str, content: str, param: str) -> str:
    """The summary sealed in ``content``; a 400 naming ``param`` when it was not made
    by a server on this store for this model, or was changed since."""

    def refuse(why: str) -> ApiError:
        return ApiError.bad_request(
            f"Invalid compaction item: {why}.", param, "invalid_encrypted_content"
        )

    signed, dot, tag = content.rpartition(".")
    if not signed.startswith(PREFIX) or not dot:
        raise refuse("it was not made by this server's /v1/responses/compact")
    if not hmac.compare_digest(tag.encode(), _tag(key, signed).encode()):
        raise refuse("it was changed, or made by a server that does not share this store")
    try:
        payload = orjson.loads(_unb64(signed.removeprefix(PREFIX)))
    except (binascii.Error, ValueError, orjson.JSONDecodeError):
        raise refuse("its content does not decode") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("summary"), str):
        raise refuse("its content does not decode")
    if payload.get("model") != model:
        raise refuse(f"it was made for another model ({str(payload.get('model'))[:64]!r})")
    summary: str = payload["summary"]
    return summary


def summaries(
    key: bytes, model: str, history: Sequence[Item], inputs: Sequence[Item]
) -> dict[str, str]:
    """Every compaction item's summary, by its ``encrypted_content``."""
    found: dict[str, str] = {}
    for where, items in (("previous_response_id", history), ("input", inputs)):
        for index, item in enumerate(items):
            if item["type"] == "compaction" and item["encrypted_content"] not in found:
                param = f"input[{index}].encrypted_content" if where == "input" else where
                content = item["encrypted_content"]
                found[content] = unseal(key, model, content, param)
    return found

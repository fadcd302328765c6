"""Server-sent events framing: data-only frames for chat and completions."""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


def data_frame(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def data_frames(payloads: list[Any]) -> bytes:
    """Several frames in one buffer: one socket write per engine step."""
    return b"".join(b"data: " + orjson.dumps(p) + b"\n\n" for p in payloads)

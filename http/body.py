"""Reading a request body: the route's size limit, the content coding and a deadline, each
refusal an ``ApiError`` in OpenAI's envelope.

aiohttp's own decompression is switched off (``create_app``'s ``auto_decompress``) and done
here, because aiohttp's failures escape the envelope: a gzip or deflate body that does not
decode raised a bare ``ContentEncodingError`` (a 500 with a traceback), ``br`` and ``zstd``
without their optional libraries were a plain-text 400 before any middleware ran, and an
unknown coding was silently read as if it were none.

* ``Content-Encoding`` absent or ``identity``: the body as sent. ``gzip`` (and its old
  name ``x-gzip``), or ``deflate`` (zlib-wrapped, or raw as some clients send it): a body
  that does not decode, or ends early, is a 400 naming the coding. Anything else, ``br``
  and ``zstd`` included, or more than one coding, is a 415 with ``Accept-Encoding``
  listing what is accepted (RFC 9110 §12.5.3).
* The limit applies to the body both as sent and as decoded, decoding stopping as soon
  as it is passed (a gzip bomb inflates no further than the limit), and a
  ``Content-Length`` above it is refused before a byte is read: 413 naming the limit.
* The body must keep arriving: by ``BODY_GRACE_S`` seconds plus one second per
  ``BODY_MIN_RATE`` bytes received so far, or the request is a 408 and the connection is
  closed (RFC 9110 §15.5.9), so a client that sends headers and trickles the body never
  holds a handler for longer than its data pays for.
"""

from __future__ import annotations

import zlib
from collections.abc import Awaitable
from typing import Protocol

import anyio
from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError

from sluice.http.errors import ApiError

ACCEPT_ENCODING = "gzip, deflate"
"""The content codings a request body may have besides none (``identity``)."""
BODY_GRACE_S = 10.0
BODY_MIN_RATE = 64 << 10
"""Bytes a second, on average after the grace: 32 MiB may take up to 522 s, no longer."""

_IDENTITY = frozenset({"", "identity"})
_ZLIB_WINDOW = zlib.MAX_WBITS


class ReadJson(Protocol):
    """The app's ``read_json``: the body as a JSON object, under the app's size limit or a
    route's lower ``max_bytes`` (``limit_note`` says why, in the 413)."""

    def __call__(
        self, request: web.Request, *, max_bytes: int | None = None, limit_note: str = ""
    ) -> Awaitable[dict[str, object]]: ...


async def read_body(request: web.Request, max_bytes: int, *, limit_note: str = "") -> bytes:
    """The body, decoded from its ``Content-Encoding``; every refusal an ``ApiError``."""
    inflater = _inflater(request.headers.getall(hdrs.CONTENT_ENCODING, []))

    def too_large() -> ApiError:
        return ApiError(
            413,
            f"The request body is larger than {max_bytes} bytes, the limit{limit_note}.",
            code="request_too_large",
        )

    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise too_large()
    body = bytearray()
    received = 0
    started = anyio.current_time()
    while True:
        deadline = started + BODY_GRACE_S + received / BODY_MIN_RATE
        chunk = b""
        with anyio.move_on_after(deadline - anyio.current_time()) as waiting:
            chunk = await _next_chunk(request)
        if waiting.cancelled_caught:
            raise ApiError(
                408,
                f"The request body did not arrive in time: {received} bytes in "
                f"{anyio.current_time() - started:.1f} s (the limit: {BODY_GRACE_S:g} s, "
                f"plus 1 s for every {BODY_MIN_RATE >> 10} KiB received).",
                code="request_timeout",
                type="invalid_request_error",
            )
        if not chunk:
            break
        received += len(chunk)
        if received > max_bytes:
            raise too_large()
        if inflater is None:
            body += chunk
        else:
            decoded = inflater.feed(chunk, max_bytes - len(body))
            if decoded is None:
                raise too_large()
            body += decoded
    if inflater is not None:
        inflater.finish()
    return bytes(body)


async def _next_chunk(request: web.Request) -> bytes:
    try:
        return await request.content.readany()
    except HttpProcessingError as exc:
        # Broken chunked framing: aiohttp answers the connection itself (a plain-text
        # 400), and the body being read fails here too.
        raise ApiError.bad_request(f"The request body could not be read: {exc.message}") from None
    except ConnectionError:  # the client left; this answer reaches no one, but logs cleanly
        raise ApiError.bad_request("The connection closed before the body was complete.") from None


def _inflater(headers: list[str]) -> _Inflater | None:
    """The decoder the ``Content-Encoding`` headers call for; 415 for any it cannot be."""
    codings = [c.strip().lower() for header in headers for c in header.split(",")]
    codings = [c for c in codings if c not in _IDENTITY]
    if not codings:
        return None
    if len(codings) == 1 and codings[0] in ("gzip", "x-gzip", "deflate"):
        return _Inflater(codings[0])
    shown = ", ".join(codings)
    raise ApiError(
        415,
        f"Unsupported Content-Encoding {shown!r}: send the body as it is, or compressed "
        f"with one of: {ACCEPT_ENCODING}.",
        code="unsupported_content_encoding",
        headers={"Accept-Encoding": ACCEPT_ENCODING},
    )


class _Inflater:
    """gzip or deflate, decoded as it arrives and never past the room left under the limit."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self._stream: zlib._Decompress | None = None

    def feed(self, data: bytes, room: int) -> bytes | None:
        """The decoded bytes, or None once they would pass ``room``."""
        out: list[bytes] = []
        while data:
            if self._stream is None:
                self._stream = self._start(data)
            elif self._stream.eof:
                if self.coding == "deflate":
                    raise self._undecodable("data after the end of the compressed stream")
                self._stream = self._start(data)  # gzip allows several members in a row
            try:
                # One byte past the room: it tells a body at the limit from one over it.
                piece = self._stream.decompress(data, room + 1)
            except zlib.error as exc:
                raise self._undecodable(str(exc)) from None
            if len(piece) > room:
                return None
            room -= len(piece)
            out.append(piece)
            # Short of max_length, decompress consumed all its input; only a finished
            # stream leaves some (the next gzip member).
            data = self._stream.unused_data if self._stream.eof else b""
        return b"".join(out)

    def finish(self) -> None:
        if self._stream is not None and not self._stream.eof:
            raise self._undecodable("the compressed data ends early")

    def _start(self, first: bytes) -> zlib._Decompress:
        if self.coding != "deflate":
            return zlib.decompressobj(16 + _ZLIB_WINDOW)
        # RFC 9110's deflate is zlib-wrapped (RFC 1950: compression method 8 in the first
        # byte's low bits); some clients send raw deflate, which aiohttp accepted too.
        wrapped = first[0] & 0x0F == 8
        return zlib.decompressobj(_ZLIB_WINDOW if wrapped else -_ZLIB_WINDOW)

    def _undecodable(self, detail: str) -> ApiError:
        return ApiError.bad_request(
            f"The request body is not valid {self.coding} data (Content-Encoding: "
            f"{self.coding}): {detail}.",
            code="invalid_content_encoding",
        )

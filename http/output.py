"""Where a route's bytes go: an aiohttp response, or a buffer (replay, recording).

Routes write through ``ResponseOutput`` so the same code serves clients and
re-runs recordings byte for byte.
"""

from __future__ import annotations

from typing import Protocol

import orjson
from aiohttp import web

from sluice.events.recorder import Recording


def json_response(body: object) -> web.Response:
    """A 200 JSON body, encoded with orjson."""
    return web.Response(body=orjson.dumps(body), content_type="application/json")


class ResponseOutput(Protocol):
    async def start_stream(self) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def finish_json(self, status: int, body: bytes) -> None: ...


class HttpOutput:
    """Writes to the client; ``response`` is what the handler returns."""

    def __init__(self, request: web.Request, extra_headers: dict[str, str] | None = None) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None
        self.extra_headers = extra_headers or {}

    async def start_stream(self) -> None:
        response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                **self.extra_headers,
            },
        )
        await response.prepare(self.request)
        self.response = response

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    async def finish_json(self, status: int, body: bytes) -> None:
        self.response = web.Response(
            status=status, body=body, content_type="application/json", headers=self.extra_headers
        )


class BufferOutput:
    """Collects the bytes (replay)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.status = 200

    async def start_stream(self) -> None:
        self.status = 200

    async def write(self, data: bytes) -> None:
        self.data += data

    async def finish_json(self, status: int, body: bytes) -> None:
        self.status = status
        self.data += body


class RecordingOutput:
    """Passes bytes through to ``inner`` and keeps a copy for the recording: streamed
    bytes gather in a buffer that ``settle`` hands over once, when the request ends
    (copying the buffer at every write made recording quadratic in the stream)."""

    def __init__(self, inner: ResponseOutput, recording: Recording) -> None:
        self.inner = inner
        self.recording = recording
        self._buffer = bytearray()

    async def start_stream(self) -> None:
        await self.inner.start_stream()

    async def write(self, data: bytes) -> None:
        self._buffer += data
        await self.inner.write(data)

    def settle(self) -> None:
        """The streamed bytes become the recording's output (a unary body is already)."""
        if self._buffer:
            self.recording.output = bytes(self._buffer)

    async def finish_json(self, status: int, body: bytes) -> None:
        self.recording.status = status
        self.recording.output = body
        await self.inner.finish_json(status, body)

"""WebSocket mode: ``GET /v1/responses`` upgraded to a WebSocket.

The client sends ``response.create`` events (the ``POST /v1/responses`` body, plus the
optional ``stream_id`` lane); the server sends each response's ``response.*`` events,
the same ones the SSE stream carries, as one JSON text message each (with the lane's
``stream_id`` when one was given), and any refusal as an ``error`` event carrying the
HTTP status the POST would have had.

* **Lanes.** Turns with the same ``stream_id`` (or none) run one after another, in
  the order they came; different lanes run concurrently. Each turn is admitted like
  any request (429 / 503 come back as ``error`` events).
* **Memory.** The connection remembers its own ``store: false`` responses, so a turn
  may continue one with ``previous_response_id`` and only the new input; stored
  responses are read from the store as over HTTP. A new connection remembers nothing
  (``previous_response_not_found``), and a failed continuation forgets the response
  it continued, so a retry never builds on state that led to an error (a refusal to
  admit it, 429 or 503, keeps it: the retry may work).
* **Limits.** Messages up to the HTTP body limit (larger closes the socket with 1009),
  ``MAX_LANES`` lanes with turns queued or running,
  ``MAX_PENDING`` turns queued or running, and a message rate (``MessageRate``); over
  them, an ``error`` event, and the connection stays usable.
* **Ends.** Closing the socket cancels its running turns (a stored one becomes
  ``cancelled``); server shutdown closes every socket with 1001 once the drain ends.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson
import structlog
from aiohttp import WSCloseCode, WSMsgType, web
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from sluice.http.admission import RETRY_AFTER_S
from sluice.http.errors import ApiError
from sluice.http.json_body import decode_json_body
from sluice.http.output import BufferOutput
from sluice.http.protocol.fields import show
from sluice.http.protocol.response_items import Item
from sluice.http.routes.responses.create import SocketTurn, run_responses
from sluice.http.routes.responses.service import SERVICE_KEY, ResponsesService
from sluice.http.state import LIFECYCLE_KEY, ServerState

MAX_LANES = 16
MAX_PENDING = 32
MAX_REMEMBERED = 64
SHUTDOWN_CLOSE_S = 5.0
MESSAGES_PER_S = 32.0
MESSAGE_BURST = 64.0
STREAM_ID = re.compile(r"[A-Za-z0-9_.-]{1,256}")

log = structlog.get_logger("sluice.responses")


class MessageRate:
    """A token bucket over the client's messages: ``MESSAGE_BURST`` at once,
    ``MESSAGES_PER_S`` after."""

    def __init__(self) -> None:
        self.per_s, self.burst = MESSAGES_PER_S, MESSAGE_BURST
        self.tokens = self.burst
        self.at = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.per_s)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class ConnectionMemory:
    """The conversations of this connection's ``store: false`` responses, newest kept."""

    def __init__(self, capacity: int = MAX_REMEMBERED) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, list[Item]] = OrderedDict()

    def recall(self, response_id: str) -> list[Item] | None:
        conversation = self._items.get(response_id)
        if conversation is not None:
            self._items.move_to_end(response_id)
        return conversation

    def remember(self, response_id: str, conversation: list[Item]) -> None:
        self._items[response_id] = conversation
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def forget(self, response_id: str) -> None:
        self._items.pop(response_id, None)


@dataclass
class Create:
    """One ``response.create``: the create body and its lane."""

    body: dict[str, Any]
    stream_id: str | None


def parse_client_event(raw: bytes) -> Create:
    """A client message as a create request, or the 400 that says why it is not one."""
    body = decode_json_body(raw)
    kind = body.pop("type", None)
    if kind != "response.create":
        raise ApiError.bad_request(
            f"Unsupported client event type {show(kind)}: this server accepts response.create.",
            "type",
            "unsupported_event_type",
        )
    stream_id = body.pop("stream_id", None)
    if stream_id is not None and not (
        isinstance(stream_id, str) and STREAM_ID.fullmatch(stream_id)
    ):
        raise ApiError.bad_request(
            "stream_id must be 1 to 256 characters of letters, digits, '_', '.' or '-'.",
            "stream_id",
        )
    if body.get("background") is True:
        raise ApiError.bad_request("background is not supported over WebSocket.", "background")
    if body.get("stream", True) is not True:
        raise ApiError.bad_request(
            "Over WebSocket a response always streams: leave stream out.", "stream"
        )
    body["stream"] = True
    return Create(body, stream_id)


@dataclass
class Connection:
    """One WebSocket: its lanes, its memory, and one lock over its writes."""

    ws: web.WebSocketResponse
    state: ServerState
    service: ResponsesService
    tasks: TaskGroup
    memory: ConnectionMemory = field(default_factory=ConnectionMemory)
    lanes: dict[str | None, MemoryObjectSendStream[Create]] = field(default_factory=dict)
    pending: int = 0
    rate: MessageRate = field(default_factory=MessageRate)
    _write: anyio.Lock = field(default_factory=anyio.Lock)

    async def send(self, data: bytes, stream_id: str | None) -> None:
        """One message; dropped once the socket is gone (the receive loop then ends the
        connection, and its turns with it)."""
        if stream_id is not None:  # the event is a JSON object: the lane is its last key
            data = data[:-1] + b',"stream_id":' + orjson.dumps(stream_id) + b"}"
        async with self._write:
            with contextlib.suppress(ConnectionError):
                await self.ws.send_str(data.decode())

    async def send_error(self, error: ApiError, stream_id: str | None) -> None:
        event: dict[str, Any] = {"type": "error", "status": error.status, **error.body()}
        if error.headers:
            event["error"]["headers"] = error.headers
        await self.send(orjson.dumps(event), stream_id)

    async def receive(self, message: bytes) -> None:
        """One client message: queued on its lane, or refused with an ``error`` event."""
        stream_id: str | None = None
        try:
            if not self.rate.take():
                raise ApiError(
                    429,
                    "Too many messages on this WebSocket connection: slow down.",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            create = parse_client_event(message)
            stream_id = create.stream_id
            self._enqueue(create)
        except ApiError as exc:
            await self.send_error(exc, stream_id)

    def _enqueue(self, create: Create) -> None:
        if self.pending >= MAX_PENDING:
            raise ApiError(
                429,
                f"This WebSocket connection already has {MAX_PENDING} responses queued or "
                "running: wait for one to finish.",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        lane = self.lanes.get(create.stream_id)
        if lane is None:
            if len(self.lanes) >= MAX_LANES:
                raise ApiError.bad_request(
                    f"This WebSocket connection has reached its stream limit ({MAX_LANES}).",
                    "stream_id",
                    "websocket_stream_limit_reached",
                )
            lane, receive = anyio.create_memory_object_stream[Create](MAX_PENDING)
            self.lanes[create.stream_id] = lane
            self.tasks.start_soon(self._run_lane, create.stream_id, receive)
        self.pending += 1
        lane.send_nowait(create)

    async def _run_lane(
        self, stream_id: str | None, turns: MemoryObjectReceiveStream[Create]
    ) -> None:
        """The lane's turns in order; an idle lane closes (the limit counts open lanes)."""
        async with turns:
            while True:
                create = await turns.receive()
                try:
                    await self._turn(create)
                finally:
                    self.pending -= 1
                # No await between this check and the close: nothing can be queued meanwhile.
                if turns.statistics().current_buffer_used == 0:
                    self.lanes.pop(stream_id).close()
                    return

    async def _turn(self, create: Create) -> None:
        async def sink(events: list[tuple[str, bytes]]) -> None:
            for _kind, data in events:
                await self.send(data, create.stream_id)

        turn = SocketTurn(sink, self.memory)
        previous = create.body.get("previous_response_id")
        retryable = False
        try:
            # Nothing is written to the output: the turn's events go to its sink.
            await run_responses(self.state, create.body, BufferOutput(), service=self.service,
                                socket=turn)  # fmt: skip
        except ApiError as exc:
            retryable = exc.status in (429, 503)  # not admitted: retrying may work
            await self.send_error(exc, create.stream_id)
        except Exception:
            log.exception("websocket turn failed", stream_id=create.stream_id)
            await self.send_error(ApiError(500, "Internal server error"), create.stream_id)
        failed = turn.status not in ("completed", "incomplete")
        if failed and not retryable and isinstance(previous, str):
            self.memory.forget(previous)


async def _serve(
    request: web.Request, max_message_bytes: int, sockets: set[web.WebSocketResponse]
) -> web.StreamResponse:
    ws = web.WebSocketResponse(max_msg_size=max_message_bytes)
    if not ws.can_prepare(request).ok:
        raise ApiError(
            426,
            "GET /v1/responses is WebSocket mode: send an Upgrade: websocket request, or "
            "POST to create a response.",
            headers={"Upgrade": "websocket", "Connection": "Upgrade"},
        )
    state = request.app[LIFECYCLE_KEY].state
    await ws.prepare(request)
    sockets.add(ws)
    log.info("responses.websocket.open", peer=request.remote)
    connection: Connection | None = None
    try:
        async with anyio.create_task_group() as tasks:
            connection = Connection(ws, state, request.app[SERVICE_KEY], tasks)
            async for message in ws:
                if message.type is WSMsgType.TEXT:
                    await connection.receive(message.data.encode())
                elif message.type is WSMsgType.BINARY:
                    await connection.send_error(
                        ApiError.bad_request("Send each client event as a JSON text message."), None
                    )
            # The client closed (or the server did): its turns end with it.
            tasks.cancel_scope.cancel()
    finally:
        sockets.discard(ws)
        if connection is not None:  # lanes still holding turns
            for lane in connection.lanes.values():
                lane.close()
        log.info("responses.websocket.closed", code=ws.close_code)
    return ws


async def _going_away(ws: web.WebSocketResponse) -> None:
    await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")


def register_websocket(app: web.Application, route: str, max_message_bytes: int) -> None:
    """The upgrade route, and the shutdown that closes the sockets still open."""
    sockets: set[web.WebSocketResponse] = set()

    async def handle(request: web.Request) -> web.StreamResponse:
        return await _serve(request, max_message_bytes, sockets)

    async def on_shutdown(app: web.Application) -> None:
        # Together, and bounded: a client that stopped reading must not hold up the rest.
        with anyio.move_on_after(SHUTDOWN_CLOSE_S):
            async with anyio.create_task_group() as closing:
                for ws in list(sockets):
                    closing.start_soon(_going_away, ws)

    app.on_shutdown.append(on_shutdown)
    app.router.add_get(route, handle)

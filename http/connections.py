"""Bounded connections: slow or idle clients cannot hold the server's file descriptors
while fast clients wait, and running out of descriptors costs one log line an interval.

- ``raise_open_file_limit``: each connection holds a descriptor, and services often
  start with a soft limit of 1 024 under a much higher hard one.
- ``Connections``: the protocol factory. It keeps at most ``max_connections`` open;
  at the cap a new connection closes the one that has waited longest for a request
  (idle, or still sending its head or body), and only when every connection has a
  request the server has fully received is the new one answered 503. A request's head
  must arrive within ``header_timeout`` of connecting (on a kept-alive connection, of
  its first byte).
- ``GuardedSite``: ``web.TCPSite``'s listening socket, with ``Connections`` making
  its connections.
- ``log_accept_errors``: asyncio logs each failed ``accept()`` with a traceback, many
  times a tick; this counts them and logs once an interval.
"""

from __future__ import annotations

import asyncio
import errno
import resource
import ssl
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import structlog
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

from sluice.http.errors import ApiError

log = structlog.get_logger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 30.0
# Descriptors kept back from connections for the server's own: the listening socket,
# model files, the responses database, engine workers' sockets, refusals in progress.
RESERVED_FDS = 128
# Past this many, connections cost more memory than they are worth to one engine.
MAX_DEFAULT_CONNECTIONS = 16384
LOG_INTERVAL_S = 10.0
ACCEPT_ERROR = "socket.accept() out of system resource"  # asyncio's message
# A refused client gets this long to read its 503 and hang up; past this many
# refusals in progress, further ones are closed without an answer, so that refusing
# cannot itself exhaust the descriptors.
_REFUSAL_LINGER_S = 1.0
_MAX_REFUSING = 32


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, not {self.max_connections}")
        if not self.header_timeout > 0:
            raise ValueError(f"--header-timeout must be positive, not {self.header_timeout}")


def raise_open_file_limit() -> tuple[int, int]:
    """Raises this process's open-file soft limit to its hard limit; (the soft limit
    before, the soft limit now), ``resource.RLIM_INFINITY`` for none."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # e.g. macOS, whose hard limit is "unlimited"
        log.warning("cannot raise the open-file limit", soft=soft, hard=hard, error=str(exc))
        return soft, soft
    return soft, hard


def default_max_connections(open_files: int) -> int:
    """The cap an open-file limit allows, less the server's own descriptors."""
    if open_files == resource.RLIM_INFINITY:
        return MAX_DEFAULT_CONNECTIONS
    return max(1, min(MAX_DEFAULT_CONNECTIONS, max(open_files - RESERVED_FDS, open_files // 2)))


def connection_limits(
    max_connections: int | None, header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
) -> ConnectionLimits:
    """Raises the open-file limit and sizes the cap from it (``max_connections``, when
    given, wins); logs both. Call once at start-up."""
    was, open_files = raise_open_file_limit()
    allowed = default_max_connections(open_files)
    limits = ConnectionLimits(
        allowed if max_connections is None else max_connections, header_timeout
    )
    raised = {"open_files_raised_from": _limit(was)} if was != open_files else {}
    log.info(
        "connection limits",
        open_files=_limit(open_files),
        **raised,
        max_connections=limits.max_connections,
        header_timeout_s=limits.header_timeout,
    )
    unlimited = open_files == resource.RLIM_INFINITY
    if not unlimited and limits.max_connections > open_files - RESERVED_FDS:
        log.warning(
            "--max-connections leaves too few descriptors: accept() may fail",
            max_connections=limits.max_connections,
            open_files=_limit(open_files),
            reserved=RESERVED_FDS,
        )
    return limits


def _limit(value: int) -> int | str:
    return "unlimited" if value == resource.RLIM_INFINITY else value


class _Throttled:
    """An event logged at most once an interval: the first at once, the rest as counts
    when the interval ends, so that a flood costs one line an interval and none goes
    unreported."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        interval: float,
        emit: Callable[[Counter[str]], None],
    ) -> None:
        self._loop = loop
        self._interval = interval
        self._emit = emit
        self._counts: Counter[str] = Counter()
        self._timer: asyncio.TimerHandle | None = None

    def note(self, kind: str) -> None:
        self._counts[kind] += 1
        if self._timer is None:
            self._flush()

    def _flush(self) -> None:
        if not self._counts:
            self._timer = None
            return
        counts, self._counts = self._counts, Counter()
        self._timer = self._loop.call_later(self._interval, self._flush)
        self._emit(counts)


ExceptionHandler = Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object]


def log_accept_errors(
    loop: asyncio.AbstractEventLoop, interval: float = LOG_INTERVAL_S
) -> ExceptionHandler:
    """Installs, and returns, ``loop``'s exception handler: asyncio's accept-loop
    resource errors (EMFILE and kin) as one warning an interval with their count,
    without tracebacks; everything else to the handler that was there before."""
    previous = loop.get_exception_handler()

    def emit(counts: Counter[str]) -> None:
        log.warning(
            "cannot accept connections: out of system resources",
            count=sum(counts.values()),
            errors=sorted(counts),
            interval_s=interval,
            hint="raise the open-file limit or lower --max-connections",
        )

    throttled = _Throttled(loop, interval, emit)

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if context.get("message") == ACCEPT_ERROR and isinstance(exc, OSError):
            throttled.note(errno.errorcode.get(exc.errno or 0, str(exc.errno)))
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    return handler


class Connections:
    """The protocol factory of a ``GuardedSite``: every connection of ``server``
    (``runner.server``) is made here and counted. Make it, on the running loop, before
    the site starts: it hooks ``server``'s request factory to see requests begin."""

    def __init__(self, server: web.Server, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._server = server
        # RequestHandler's options as the runner and the app set them (access log,
        # debug, the app's handler_args): web.Server keeps them to make its own.
        self._handler_kwargs: dict[str, Any] = dict(server._kwargs)
        self._open: set[_Connection] = set()
        # Connections the cap may close to make room, each oldest first: waiting for
        # a request (idle, or its head still arriving), or still receiving a body.
        self._waiting: dict[_Connection, None] = {}
        self._receiving: dict[_Connection, None] = {}
        self._refusing = 0
        self._shed = _Throttled(asyncio.get_running_loop(), LOG_INTERVAL_S, self._log_shed)
        make_request = server.request_factory

        def request_factory(
            message: RawRequestMessage,
            payload: StreamReader,
            protocol: RequestHandler,
            writer: AbstractStreamWriter,
            task: asyncio.Task[None],
        ) -> BaseRequest:
            if isinstance(protocol, _Connection):
                protocol.request_started(payload)
            return make_request(message, payload, protocol, writer, task)

        server.request_factory = request_factory

    @property
    def open(self) -> int:
        return len(self._open)

    def __call__(self) -> _Connection:
        return _Connection(
            self, self._server, loop=asyncio.get_running_loop(), **self._handler_kwargs
        )

    # What _Connection tells the gate.

    def admit(self, conn: _Connection) -> bool:
        """Whether ``conn`` may open; at the cap, at the expense of a waiting one."""
        if len(self._open) >= self.limits.max_connections:
            victims = self._waiting or self._receiving
            if not victims:
                return False
            self.shed(next(iter(victims)), "evicted")
        self._open.add(conn)
        self._waiting[conn] = None
        return True

    def request_started(self, conn: _Connection, body_pending: bool) -> None:
        self._waiting.pop(conn, None)
        if body_pending:
            self._receiving[conn] = None

    def body_received(self, conn: _Connection) -> None:
        self._receiving.pop(conn, None)

    def request_finished(self, conn: _Connection) -> None:
        self._receiving.pop(conn, None)
        if conn in self._open:
            self._waiting.pop(conn, None)  # to the end of the line
            self._waiting[conn] = None

    def closed(self, conn: _Connection) -> None:
        self._open.discard(conn)
        self._waiting.pop(conn, None)
        self._receiving.pop(conn, None)

    def shed(self, conn: _Connection, why: str) -> None:
        """Closes ``conn`` at once: aborting frees its descriptor now, where a TLS
        close would wait for the client's close_notify."""
        self.closed(conn)
        if conn.transport is not None:
            conn.transport.abort()
        self._shed.note(why)

    def refuse(self, transport: asyncio.BaseTransport) -> None:
        """A 503 on a connection past the cap, then closed."""
        if self._refusing >= _MAX_REFUSING:
            cast(asyncio.Transport, transport).abort()
            self._shed.note("dropped")
            return
        self._refusing += 1
        refusal = _Refusal(self._refusal_done, self._refusal_response())
        transport.set_protocol(refusal)
        refusal.connection_made(transport)
        self._shed.note("refused")

    def malformed(self) -> None:
        self._shed.note("malformed_request")

    def _refusal_done(self) -> None:
        self._refusing -= 1

    def _refusal_response(self) -> bytes:
        body = ApiError(
            503,
            f"The server has {self.limits.max_connections} connections open, each with a "
            "request in progress. Retry later.",
            code="too_many_connections",
        ).json()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Retry-After: 1\r\n"
            f"X-Request-Id: req_{uuid.uuid4().hex}\r\n"
            "Connection: close\r\n\r\n"
        )
        return head.encode() + body

    def _log_shed(self, counts: Counter[str]) -> None:
        # Header timeouts and malformed requests are clients' doing; the rest means the
        # cap is being reached.
        level = log.info if set(counts) <= {"header_timeout", "malformed_request"} else log.warning
        level(
            "connections closed by the limits",
            **counts,
            open=len(self._open),
            max_connections=self.limits.max_connections,
            interval_s=LOG_INTERVAL_S,
        )


class _Connection(RequestHandler):
    """aiohttp's handler, admitted by ``Connections`` and given a deadline for each
    request head."""

    __slots__ = ("_gate", "_head_deadline", "_in_request")

    def __init__(self, gate: Connections, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._gate = gate
        self._head_deadline: asyncio.TimerHandle | None = None
        self._in_request = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._gate.admit(self):
            self._gate.refuse(transport)  # this handler is never started
            return
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        # A kept-alive connection's deadline starts with the next request's first
        # byte; its idle time is aiohttp's keep-alive timeout. Bytes that arrive during
        # a request are its body (or pipelined), covered by the cap alone.
        if data and not self._in_request and self._head_deadline is None:
            self._arm()
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        self._gate.closed(self)
        super().connection_lost(exc)

    def request_started(self, payload: StreamReader) -> None:
        """From the request factory: the head has arrived and is being handled."""
        self._in_request = True
        self._disarm()
        body_pending = not payload.is_eof()
        self._gate.request_started(self, body_pending)
        if body_pending:
            payload.on_eof(lambda: self._gate.body_received(self))

    async def finish_response(
        self, request: BaseRequest, resp: StreamResponse, start_time: float | None
    ) -> tuple[StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._in_request = False
            self._gate.request_finished(self)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> StreamResponse:
        """A request aiohttp could not parse (a malformed line or header, one too long)
        is answered in OpenAI's envelope and counted in the interval's log line, with no
        traceback; anything else as aiohttp does."""
        if not isinstance(exc, HttpProcessingError) or status >= 500:
            return super().handle_error(request, status, exc, message)
        self._gate.malformed()
        reason = (exc.message or message or "malformed request").splitlines()[0][:200]
        error = ApiError(status, f"The HTTP request could not be parsed: {reason}")
        response = web.Response(status=status, body=error.json(), content_type="application/json")
        response.force_close()
        return response

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._head_deadline = loop.call_later(self._gate.limits.header_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _timed_out(self) -> None:
        self._head_deadline = None
        if not self._in_request and self.transport is not None:
            self._gate.shed(self, "header_timeout")


class _Refusal(asyncio.Protocol):
    """Writes a refusal, lets the client read it, and closes. The client's request is
    never read: closing a socket with unread data would reset it, losing the answer,
    so the write side closes first and the rest waits for the client to hang up."""

    def __init__(self, done: Callable[[], None], response: bytes) -> None:
        self._done = done
        self._response = response
        self._linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        writer = cast(asyncio.Transport, transport)
        writer.write(self._response)
        if writer.can_write_eof():
            writer.write_eof()
        self._linger = asyncio.get_running_loop().call_later(_REFUSAL_LINGER_S, writer.abort)

    def data_received(self, data: bytes) -> None:
        pass  # the refused request

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._linger is not None:
            self._linger.cancel()
        self._done()


class GuardedSite(web.BaseSite):
    """``web.TCPSite``, its connections made by ``connections``. With TLS, the
    handshake too must finish within the header timeout."""

    __slots__ = ("_connections", "_host", "_port")

    def __init__(
        self,
        runner: web.BaseRunner,
        connections: Connections,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        backlog: int = 128,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._connections = connections
        self._host = host
        self._port = port

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{scheme}://{host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        handshake = self._connections.limits.header_timeout if self._ssl_context else None
        self._server = await loop.create_server(
            self._connections,
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            ssl_handshake_timeout=handshake,
        )

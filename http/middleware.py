"""The HTTP edge: request ids and the access log, CORS, API keys, and TLS set-up.

Response headers (the request id, CORS) are added in ``on_response_prepare``, so
they reach every response: JSON, errors, and SSE streams that a route prepares
itself before the middlewares see them.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import ssl
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from sluice.http.errors import ApiError

access_log = structlog.get_logger("sluice.access")

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID = web.RequestKey("request_id", str)
# The request's Origin when it is allowed, "" when CORS is on but the origin is not.
CORS_ORIGIN = web.RequestKey("cors_origin", str)

# Public even when API keys are set (SGLang's rule): probes and scrapers carry no key.
PUBLIC_PATHS = frozenset({"/health", "/metrics"})
MAX_REQUEST_ID_CHARS = 128
CORS_MAX_AGE_S = 600
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


class ConfigError(Exception):
    """A bad security flag (key file, TLS files): a one-line start-up error."""


# Request ids and the access log


def _request_id(given: str | None) -> str:
    """The client's id when it is safe to echo and log, else a fresh one."""
    if given and len(given) <= MAX_REQUEST_ID_CHARS and given.isascii() and given.isprintable():
        return given
    return f"req_{uuid.uuid4().hex}"


@web.middleware
async def request_log_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: names the request and logs one line once its response is done."""
    request_id = _request_id(request.headers.get(REQUEST_ID_HEADER))
    request[REQUEST_ID] = request_id
    start = time.perf_counter()
    status = 500
    try:
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = 499  # nginx's "client closed request": the client went away first
        raise
    finally:
        # The path without its query string, no credentials, no body: no key can leak here.
        access_log.info(
            "request",
            method=request.method,
            path=request.path,
            status=status,
            duration_ms=round((time.perf_counter() - start) * 1000, 1),
            request_id=request_id,
            client=request.remote,
            user_agent=request.headers.get("User-Agent"),
        )


async def add_edge_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the request id and CORS headers on every response."""
    request_id = request.get(REQUEST_ID)
    if request_id is not None:
        response.headers[REQUEST_ID_HEADER] = request_id
    origin = request.get(CORS_ORIGIN)
    if origin is None:
        return
    response.headers.add("Vary", "Origin")
    if origin:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = REQUEST_ID_HEADER


# CORS


def parse_origins(values: Iterable[str]) -> tuple[str, ...]:
    """``--allowed-origins`` values, each comma-separated; browsers send no trailing /."""
    origins = (o.strip().rstrip("/").lower() for v in values for o in v.split(","))
    return tuple(dict.fromkeys(o for o in origins if o))


def cors_middleware(allowed_origins: tuple[str, ...]) -> Middleware:
    allowed = frozenset(allowed_origins)
    any_origin = "*" in allowed

    @web.middleware
    async def cors(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin", "")
        request[CORS_ORIGIN] = origin if origin and (any_origin or origin in allowed) else ""
        if request[CORS_ORIGIN] and _is_preflight(request):
            # Answered here, before the API key check: browsers send preflights without one.
            allow = {"authorization": "Authorization", "content-type": "Content-Type"}
            for name in request.headers.get("Access-Control-Request-Headers", "").split(","):
                if _HEADER_NAME.match(name := name.strip()):
                    allow.setdefault(name.lower(), name)
            return web.Response(
                status=204,
                headers={
                    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                    "Access-Control-Allow-Headers": ", ".join(allow.values()),
                    "Access-Control-Max-Age": str(CORS_MAX_AGE_S),
                },
            )
        return await handler(request)

    return cors


def _is_preflight(request: web.Request) -> bool:
    return request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers


# API keys


def read_api_keys(key: str | None, key_file: str | None) -> frozenset[str]:
    """``--api-key`` plus ``--api-key-file`` (one key a line; blanks and # comments skipped)."""
    if key is not None and not key.strip():
        # Most likely an unset variable in `--api-key "$KEY"`: never start open by accident.
        raise ConfigError("--api-key is empty")
    keys = {key.strip()} if key is not None else set()
    if key_file is not None:
        try:
            text = Path(key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read --api-key-file {key_file}: {exc}") from exc
        from_file = {s for line in text.splitlines() if (s := line.strip()) and s[0] != "#"}
        if not from_file:
            raise ConfigError(f"--api-key-file {key_file} holds no key")
        keys |= from_file
    return frozenset(keys)


def _digest(value: str) -> bytes:
    # Comparing fixed-size digests hides the keys' lengths as well as their contents.
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


def _unauthorized(message: str) -> NoReturn:
    raise ApiError(
        401, message, code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="sluice"'}
    )


def auth_middleware(
    api_keys: frozenset[str], public: Callable[[str], bool] | None = None
) -> Middleware:
    """Every route but the public ones (``PUBLIC_PATHS``, and the paths ``public``
    accepts: the web page's) needs ``Authorization: Bearer KEY``.

    It runs before the handler, which is also aiohttp's 404/405 raiser, and reads
    no body, so a request without a key learns nothing about routes or parsing.
    """
    digests = tuple(_digest(k) for k in api_keys)

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        # OPTIONS passes as in SGLang: a CORS preflight never carries credentials.
        path = request.path
        if request.method == "OPTIONS" or path in PUBLIC_PATHS or (public and public(path)):
            return await handler(request)
        header = request.headers.get("Authorization")
        if header is None:
            _unauthorized("Missing API key: send it as 'Authorization: Bearer YOUR_KEY'.")
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            _unauthorized("Malformed Authorization header: expected 'Bearer YOUR_KEY'.")
        given = _digest(token.strip())
        matched = False
        for digest in digests:  # no early exit: the timing tells nothing about which key
            matched |= hmac.compare_digest(given, digest)
        if not matched:
            _unauthorized("Incorrect API key provided.")
        return await handler(request)

    return check_api_key


# TLS


def tls_context(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    """The server's TLS context from ``--ssl-certfile``/``--ssl-keyfile``; None for plain HTTP."""
    if certfile is None and keyfile is None:
        return None
    if certfile is None or keyfile is None:
        raise ConfigError("--ssl-certfile and --ssl-keyfile must be given together")
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if not Path(path).is_file():
            raise ConfigError(f"{flag} {path}: no such file")

    def no_password() -> NoReturn:
        # Without a callback OpenSSL would prompt on the terminal and block start-up.
        raise ConfigError(f"--ssl-keyfile {keyfile} is encrypted: give an unencrypted key")

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile, password=no_password)
    except OSError as exc:  # ssl.SSLError included
        raise ConfigError(
            f"cannot load TLS certificate {certfile} with key {keyfile} (both PEM, "
            f"the key matching the certificate): {exc}"
        ) from exc
    return context

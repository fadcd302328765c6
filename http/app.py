"""The aiohttp application: routes, JSON bodies, and one error envelope for all."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import orjson
import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from sluice.http.body import read_body
from sluice.http.errors import ApiError
from sluice.http.json_body import decode_json_body
from sluice.http.metrics import count_requests, metrics_endpoint
from sluice.http.middleware import (
    add_edge_headers,
    auth_middleware,
    cors_middleware,
    request_log_middleware,
)
from sluice.http.output import HttpOutput
from sluice.http.routes.chat import run_chat
from sluice.http.routes.completions import run_completion
from sluice.http.routes.native import register as register_native
from sluice.http.routes.native import run_generate
from sluice.http.routes.responses import ResponsesService
from sluice.http.routes.responses import register as register_responses
from sluice.http.state import LIFECYCLE_KEY, Lifecycle, ServerState
from sluice.http.webui import is_page_path, register_webui
from sluice.pipeline.chat import ChatSetup
from sluice.pipeline.errors import InvalidRequest
from sluice.pipeline.template_sources import BUILTIN_NAMES

log = structlog.get_logger(__name__)

MAX_BODY_BYTES = 32 << 20
"""The largest body any route reads, decoded; a route may set a lower one (``read_json``)."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(error: ApiError) -> web.Response:
    response = web.Response(
        status=error.status,
        body=error.json(),
        content_type="application/json",
        headers=error.headers,
    )
    if error.status == 408:
        # The server gave up waiting on the body (RFC 9110 §15.5.9): the connection
        # closes, once aiohttp's lingering read has given the client time to see this.
        response.force_close()
    return response


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as OpenAI's ``{"error": {...}}``, whatever raised it."""
    try:
        return await handler(request)
    except ApiError as exc:
        return _error_response(exc)
    except InvalidRequest as exc:  # a pipeline refusal outside a request scope
        return _error_response(ApiError.bad_request(exc.message, exc.param, exc.code))
    except web.HTTPRequestEntityTooLarge:
        return _error_response(
            ApiError(
                413,
                f"The request body is larger than {MAX_BODY_BYTES} bytes, the limit.",
                code="request_too_large",
            )
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {
            404: f"Not found: {request.path}",
            405: f"Method {request.method} is not allowed on {request.path}",
        }
        # 405 must say what is allowed (RFC 9110); aiohttp put it in the exception's headers.
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        error = ApiError(exc.status, message.get(exc.status, exc.reason), headers=allow)
        return _error_response(error)
    except Exception:
        log.exception("unhandled error", path=request.path)
        return _error_response(ApiError(500, "Internal server error"))


async def read_json(
    request: web.Request, *, max_bytes: int | None = None, limit_note: str = ""
) -> dict[str, object]:
    """The body as a JSON object (see ``json_body``), read by ``body.read_body`` under
    ``MAX_BODY_BYTES`` or a route's lower ``max_bytes`` (``limit_note`` says why)."""
    content_type = request.headers.get("Content-Type", "application/json")
    if not content_type.split(";")[0].strip().lower().endswith("json"):
        raise ApiError.bad_request(
            f"Unsupported Content-Type {content_type!r}: send application/json."
        )
    if max_bytes is None or max_bytes >= MAX_BODY_BYTES:
        max_bytes, limit_note = MAX_BODY_BYTES, ""
    return decode_json_body(await read_body(request, max_bytes, limit_note=limit_note))


@web.middleware
async def readiness_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """503 while the model loads and once shutdown began; ``/metrics`` and the web page
    always answer (the page then says the server is loading)."""
    if request.path != "/metrics" and not is_page_path(request.path):
        request.app[LIFECYCLE_KEY].check_ready()
    return await handler(request)


async def health(request: web.Request) -> web.Response:
    """``ok``; with engine workers (``--dp-size``) some of which are down, ``degraded``
    while any is up (the rest serve), 503 when none is."""
    workers = request.app[LIFECYCLE_KEY].state.pipeline.engine.stats().workers
    up = sum(w.up for w in workers)
    if up == len(workers):
        return web.Response(text="ok")
    if up == 0:
        raise ApiError(503, "No engine worker is up.", code="engine_unavailable",
                       headers={"Retry-After": "1"})  # fmt: skip
    return web.Response(text=f"degraded: {up} of {len(workers)} engine workers up")


def _model_card(state: ServerState) -> dict[str, object]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "sluice",
        # SGLang's ``root`` is the served name; a filesystem path is never shown.
        "root": state.model_name,
        "max_model_len": state.pipeline.context_length,
        **(state.facts.card() if state.facts is not None else {}),
        **_chat_card(state.chat),
    }


def _chat_card(chat: ChatSetup | None) -> dict[str, object]:
    """Which chat template the server renders with and the formats it implies."""
    if chat is None:
        return {"chat_template": None, "tool_call_parser": None, "reasoning_parser": None}
    spec = chat.flags.get("chat_template")
    template = "model" if spec is None else spec if spec in BUILTIN_NAMES else "file"
    return {
        "chat_template": template,
        "tool_call_parser": chat.tools.parser,
        "reasoning_parser": chat.reasoning_parser,
    }


async def list_models(request: web.Request) -> web.Response:
    state = request.app[LIFECYCLE_KEY].state
    body = {"object": "list", "data": [_model_card(state)]}
    return web.json_response(body, dumps=lambda o: orjson.dumps(o).decode())


async def retrieve_model(request: web.Request) -> web.Response:
    state = request.app[LIFECYCLE_KEY].state
    # ids may contain "/": accept it raw (org/name) and percent-encoded (org%2Fname).
    # Decode the raw path once: match_info is decoded already except for %2F.
    model = unquote(request.raw_path.split("?", 1)[0][len("/v1/models/") :])
    if model != state.model_name:
        raise ApiError(
            404,
            f"The model '{model}' does not exist",
            param="model",
            code="model_not_found",
        )
    return web.json_response(_model_card(state), dumps=lambda o: orjson.dumps(o).decode())


RouteRunner = Callable[[ServerState, Any, HttpOutput], Awaitable[None]]


def generation_handler(run: RouteRunner) -> Handler:
    """An aiohttp handler for a generation route: JSON in, JSON or SSE out."""

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        output = HttpOutput(request)
        try:
            await run(request.app[LIFECYCLE_KEY].state, body, output)
        except ConnectionError:
            # The client went away mid-stream; leaving the route cancelled its sequences.
            if output.response is None:
                raise
        assert output.response is not None
        return output.response

    return handle


def create_app(
    server: ServerState | Lifecycle,
    *,
    api_keys: frozenset[str] = frozenset(),
    allowed_origins: tuple[str, ...] = (),
    responses: ResponsesService | None = None,
    webui: bool = True,
) -> web.Application:
    """``server``: a state to serve at once (tests, replay), or the lifecycle of a server
    that listens while its model loads (the CLI). ``responses``: the Responses store and
    background tasks (default: an in-memory store). ``webui``: the page at ``/``."""
    lifecycle = server if isinstance(server, Lifecycle) else Lifecycle.serving(server)
    # Outermost first: the access log sees every outcome; CORS answers preflights
    # before the key check; the key check runs inside the error envelope and
    # before the handler (aiohttp's 404/405 raiser included) reads any body;
    # readiness (503 while loading or draining) comes last, after the key check.
    middlewares: list[Middleware] = [request_log_middleware, count_requests(lifecycle.metrics)]
    if allowed_origins:
        middlewares.append(cors_middleware(allowed_origins))
    middlewares.append(error_middleware)
    if api_keys:
        public = is_page_path if webui else None
        middlewares.append(auth_middleware(api_keys, public))
    middlewares.append(readiness_middleware)
    # Bodies are decompressed by ``read_json`` (``body.py``), where a failure can be
    # answered in the envelope; aiohttp's own decoding fails outside it.
    app = web.Application(
        middlewares=middlewares,
        client_max_size=MAX_BODY_BYTES,
        handler_args={"auto_decompress": False},
    )
    app.on_response_prepare.append(add_edge_headers)
    app[LIFECYCLE_KEY] = lifecycle
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint(lifecycle))
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)
    app.router.add_post("/v1/completions", generation_handler(run_completion))
    app.router.add_post("/v1/chat/completions", generation_handler(run_chat))
    register_responses(
        app,
        responses or ResponsesService.in_memory(),
        read_json=read_json,
        handler=generation_handler,
        max_body_bytes=MAX_BODY_BYTES,
    )
    # SGLang's worker API, for SGLang's gateway and clients.
    app.router.add_post("/generate", generation_handler(run_generate))
    register_native(app, read_json)
    if webui:
        register_webui(app)
    return app

"""The aiohttp application: routes, JSON bodies, and one error envelope for all."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import orjson
import structlog
from aiohttp import web

from sluice.http.errors import ApiError
from sluice.http.metrics import metrics
from sluice.http.output import HttpOutput
from sluice.http.routes.chat import run_chat
from sluice.http.routes.completions import run_completion
from sluice.http.state import STATE_KEY, ServerState

log = structlog.get_logger(__name__)

MAX_BODY_BYTES = 32 << 20

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(error: ApiError) -> web.Response:
    return web.Response(
        status=error.status,
        body=error.json(),
        content_type="application/json",
        headers=error.headers,
    )


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as OpenAI's ``{"error": {...}}``, whatever raised it."""
    try:
        return await handler(request)
    except ApiError as exc:
        return _error_response(exc)
    except web.HTTPRequestEntityTooLarge:
        return _error_response(
            ApiError(413, f"Request body is too large (the limit is {MAX_BODY_BYTES} bytes).")
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {
            404: f"Not found: {request.path}",
            405: f"Method {request.method} is not allowed on {request.path}",
        }
        return _error_response(ApiError(exc.status, message.get(exc.status, exc.reason)))
    except Exception:
        log.exception("unhandled error", path=request.path)
        return _error_response(ApiError(500, "Internal server error"))


async def read_json(request: web.Request) -> object:
    content_type = request.headers.get("Content-Type", "application/json")
    if not content_type.split(";")[0].strip().lower().endswith("json"):
        raise ApiError.bad_request(
            f"Unsupported Content-Type {content_type!r}: send application/json."
        )
    raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError.bad_request(f"Invalid JSON body: {exc}") from None


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def _model_card(state: ServerState) -> dict[str, object]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "sluice",
        "root": state.model_root,
        "max_model_len": state.pipeline.context_length,
    }


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = {"object": "list", "data": [_model_card(state)]}
    return web.json_response(body, dumps=lambda o: orjson.dumps(o).decode())


async def retrieve_model(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
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
            await run(request.app[STATE_KEY], body, output)
        except ConnectionError:
            # The client went away mid-stream; leaving the route cancelled its sequences.
            if output.response is None:
                raise
        assert output.response is not None
        return output.response

    return handle


def create_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    app[STATE_KEY] = state
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)
    app.router.add_post("/v1/completions", generation_handler(run_completion))
    app.router.add_post("/v1/chat/completions", generation_handler(run_chat))
    return app

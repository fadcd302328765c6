"""``/v1/responses``: stateful responses over the chat pipeline.

* ``create``: ``POST /v1/responses`` (stream, unary, background) and the turns of
  ``websocket`` (``GET /v1/responses`` upgraded: WebSocket mode).
* ``compact``: ``POST /v1/responses/compact``.
* ``reads``: ``GET`` / ``DELETE`` / ``POST …/cancel`` / ``GET …/input_items`` /
  ``GET …/events`` (the log with its times).
* ``generation``: one response being generated (projection, store, trace);
  ``service``: the store, background tasks and live runs of a server; ``elsewhere``:
  responses another front end sharing the store runs.

Every lifecycle transition is one structlog line (``sluice.responses``) with the ids,
status, timings and token counts; prompt and output text only with ``--trace-prompts``.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from sluice.http.output import HttpOutput
from sluice.http.routes.responses.compact import compact_handler
from sluice.http.routes.responses.create import replay_options, run_responses
from sluice.http.routes.responses.reads import (
    cancel_response,
    delete_response,
    get_response,
    list_events,
    list_input_items,
)
from sluice.http.routes.responses.service import ROUTE, SERVICE_KEY, ResponsesService
from sluice.http.routes.responses.websocket import register_websocket
from sluice.http.state import ServerState

ReadJson = Callable[[web.Request], Awaitable[dict[str, object]]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
RouteRunner = Callable[[ServerState, Any, HttpOutput], Awaitable[None]]


def register(
    app: web.Application,
    service: ResponsesService,
    *,
    read_json: ReadJson,
    handler: Callable[[RouteRunner], Handler],
    max_body_bytes: int,
) -> None:
    """The Responses routes (``handler`` makes the create route as the app makes every
    generation route; a WebSocket message may be as large as a body), and the
    service's start (mark interrupted responses) and close (stop background tasks,
    close the store)."""
    app[SERVICE_KEY] = service

    async def on_startup(app: web.Application) -> None:
        await service.start()

    async def on_cleanup(app: web.Application) -> None:
        await service.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post(ROUTE, handler(functools.partial(run_responses, service=service)))
    app.router.add_post(ROUTE + "/compact", compact_handler(read_json))
    register_websocket(app, ROUTE, max_body_bytes)
    app.router.add_get(ROUTE + "/{response_id}", get_response)
    app.router.add_delete(ROUTE + "/{response_id}", delete_response)
    app.router.add_post(ROUTE + "/{response_id}/cancel", cancel_response)
    app.router.add_get(ROUTE + "/{response_id}/input_items", list_input_items)
    app.router.add_get(ROUTE + "/{response_id}/events", list_events)


__all__ = [
    "ROUTE",
    "SERVICE_KEY",
    "ResponsesService",
    "register",
    "replay_options",
    "run_responses",
]

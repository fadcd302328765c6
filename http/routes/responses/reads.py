"""The routes that read and change stored responses: ``GET`` (``?stream=true`` follows
a running one live, or replays the stored log), ``DELETE``, ``POST …/cancel``,
``GET …/input_items``, and Sluice's ``GET …/events`` (the log with each event's time,
for the web page's lifecycle viewer). Store calls all run off the event loop (``http.store``)."""

from __future__ import annotations

from collections.abc import Sequence

import orjson
from aiohttp import web

from sluice.http.admission import RETRY_AFTER_S
from sluice.http.errors import ApiError
from sluice.http.output import HttpOutput, json_response
from sluice.http.protocol.fields import check_integer, show
from sluice.http.protocol.responses import check_response_id
from sluice.http.routes.responses.elsewhere import cancel_elsewhere, follow_logged
from sluice.http.routes.responses.generation import frame_of
from sluice.http.routes.responses.service import SERVICE_KEY, cancel_live, log
from sluice.http.store import UNFINISHED

MAX_LIST_LIMIT = 100


def _response_id(request: web.Request) -> str:
    response_id = request.match_info["response_id"]
    check_response_id(response_id, "response_id")
    return response_id


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param="response_id")


def _query(request: web.Request, allowed: Sequence[str]) -> dict[str, str]:
    """The query as a dict; an unknown or repeated parameter is a 400 naming it."""
    query: dict[str, str] = {}
    for key, value in request.query.items():
        name = key.removesuffix("[]")
        if name not in allowed:
            raise ApiError.bad_request(f"Unrecognized query parameter: {show(key)}", name)
        if name in query:
            raise ApiError.bad_request(f"Query parameter {name!r} given twice", name)
        query[name] = value
    return query


def _bool(query: dict[str, str], name: str) -> bool:
    value = query.get(name, "false").lower()
    if value not in ("true", "false"):
        raise ApiError.bad_request(f"'{name}' must be true or false, got {show(value)}", name)
    return value == "true"


def _int(query: dict[str, str], name: str, default: int, **bounds: int) -> int:
    raw = query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError.bad_request(f"'{name}' must be an integer, got {show(raw)}", name) from None
    return check_integer(name, value, **bounds)


def _refuse_include(query: dict[str, str]) -> None:
    if "include" in query:
        raise ApiError.bad_request(
            "include is not supported here: what a response includes is chosen when it is created",
            "include",
        )


async def get_response(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE_KEY]
    response_id = _response_id(request)
    query = _query(request, ("stream", "starting_after", "include", "include_obfuscation"))
    _refuse_include(query)
    if _bool(query, "include_obfuscation"):
        raise ApiError.bad_request("include_obfuscation is not supported", "include_obfuscation")
    stream = _bool(query, "stream")
    if "starting_after" in query and not stream:
        raise ApiError.bad_request("starting_after is only allowed with stream=true",
                                   "starting_after")  # fmt: skip
    after = _int(query, "starting_after", -1, minimum=0)
    live = service.live.get(response_id)
    if live is None:
        stored = await service.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        if not stream:
            return web.Response(body=stored.body, content_type="application/json")
    elif not stream:
        return json_response(live.projection.fold.response or live.projection.snapshot("queued"))
    output = HttpOutput(request)
    await output.start_stream()
    try:
        if live is not None:
            async for chunk in live.follow(after):
                await output.write(chunk)
        else:  # finished, or running on another front end that shares the store
            async for logged in follow_logged(service.store, response_id, after):
                await output.write(b"".join(frame_of(data) for data in logged))
    except ConnectionError:
        pass
    assert output.response is not None
    return output.response


async def delete_response(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    response_id = _response_id(request)
    _query(request, ())
    live = service.live.get(response_id)
    if live is not None:  # deleting a running response stops it first
        await cancel_live(live)
    if not await service.store.delete(response_id):
        raise _not_found(response_id)
    log.info("response.deleted", response_id=response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


async def cancel_response(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    response_id = _response_id(request)
    _query(request, ())
    live = service.live.get(response_id)
    if live is not None:
        await cancel_live(live)
    stored = await service.store.get(response_id)
    if stored is not None and stored.background and stored.status in UNFINISHED:
        try:  # running on another front end that shares the store
            stored = await cancel_elsewhere(service.store, response_id)
        except TimeoutError:
            raise ApiError(
                503,
                "The server running this response did not confirm the cancel. Retry.",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
    if stored is None:
        raise _not_found(response_id)
    if not stored.background:
        raise ApiError.bad_request("Cannot cancel a synchronous response.", "response_id")
    if stored.status not in ("cancelled", *UNFINISHED):
        raise ApiError.bad_request(
            f"Cannot cancel a response whose status is {stored.status!r}.", "response_id"
        )
    return web.Response(body=stored.body, content_type="application/json")


async def list_input_items(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    response_id = _response_id(request)
    query = _query(request, ("limit", "order", "after", "include"))
    _refuse_include(query)
    limit = _int(query, "limit", 20, minimum=1, maximum=MAX_LIST_LIMIT)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError.bad_request(f"'order' must be asc or desc, got {show(order)}", "order")
    after = query.get("after")
    if await service.store.get(response_id) is None:
        raise _not_found(response_id)
    page = await service.store.input_items(
        response_id, limit=limit, order="asc" if order == "asc" else "desc", after=after
    )
    if page is None:
        raise ApiError.bad_request(f"No input item with id {show(after)} in this response",
                                   "after")  # fmt: skip
    items, has_more = page
    return json_response({
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    })  # fmt: skip


async def list_events(request: web.Request) -> web.Response:
    """A stored response's whole event log, each event beside the time it was logged
    (Unix seconds; null where the store kept none). Not in OpenAI's API: the stream
    replay (``GET …?stream=true``) stays the standard way to read the events."""
    service = request.app[SERVICE_KEY]
    response_id = _response_id(request)
    _query(request, ())
    if await service.store.get(response_id) is None:
        raise _not_found(response_id)
    logged = await service.store.timed_events(response_id)
    data = [{"at": e.at, "event": orjson.Fragment(e.body)} for e in logged]
    return json_response({"object": "list", "response_id": response_id, "data": data})

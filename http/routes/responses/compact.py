"""``POST /v1/responses/compact``: a conversation (its ``previous_response_id`` history
and new input) made short enough to go on with.

The user's messages are kept verbatim; everything else (the assistant's answers, tool
calls and results, reasoning, earlier compactions) is replaced by one ``compaction``
item holding the model's own summary of the whole conversation, sealed
(``compaction_item``). A later request passes the output back as input, over HTTP or
a WebSocket, without ``previous_response_id``; the summary then reads as an assistant
turn. The summary is a greedy Responses run of the same pipeline (admitted, traced,
measured like any), with the oldest turns dropped if the conversation overflows the
context; its usage is the compaction's.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from sluice.http.errors import ApiError
from sluice.http.output import BufferOutput, json_response
from sluice.http.protocol.compaction import parse_compact_request
from sluice.http.protocol.response_items import Item, item_text
from sluice.http.routes.responses import compaction_item
from sluice.http.routes.responses.create import history_of, resolve_input, run_responses
from sluice.http.routes.responses.generation import IdMaker
from sluice.http.routes.responses.service import SERVICE_KEY, ResponsesService
from sluice.http.routes.serving import check_model
from sluice.http.state import LIFECYCLE_KEY, ServerState

SUMMARY_TOKENS = 256
SUMMARY_REQUEST = (
    "Summarize the conversation so far for your own later use: keep every fact, name, "
    "number, decision and open question that later turns may need, and the outcome of "
    "each tool call. Reply with the summary only."
)


def _is_user_message(item: Item) -> bool:
    return bool(item["type"] == "message" and item["role"] == "user")


async def compact(state: ServerState, service: ResponsesService, body: Any) -> dict[str, Any]:
    req = parse_compact_request(body)
    check_model(state, req.model)
    compaction_id = f"resp_{uuid.uuid4().hex}"
    ids = IdMaker(compaction_id)
    history = await history_of(service, req.previous_response_id, None)
    inputs = await resolve_input(service, req.input, ids)
    conversation = [*history, *inputs]
    summarize = {
        "model": req.model,
        "input": [*conversation, {"type": "message", "role": "user", "content": SUMMARY_REQUEST}],
        "instructions": req.instructions,
        **({"prompt_cache_key": req.prompt_cache_key} if req.prompt_cache_key else {}),
        "store": False,
        "temperature": 0,
        "max_output_tokens": SUMMARY_TOKENS,
        "truncation": "auto",
    }
    output = BufferOutput()
    # Its own id: the summary run names its items after it, apart from the kept ones.
    summary_id = f"resp_{uuid.uuid4().hex}"
    await run_responses(state, summarize, output, request_id=summary_id, service=service)
    summarized = orjson.loads(output.data)  # a refusal or failure raised ApiError
    summary = "".join(item_text(item) for item in summarized["output"] if item["type"] == "message")
    if not summary.strip():
        raise ApiError(500, "The model gave an empty summary: the conversation was not compacted.")
    content = compaction_item.seal(await service.compaction_key(), state.model_name, summary)
    sealed = {"id": ids("cmp"), "type": "compaction", "encrypted_content": content}
    return {
        "id": compaction_id,
        "object": "response.compaction",
        "created_at": summarized["created_at"],
        "output": [*(item for item in conversation if _is_user_message(item)), sealed],
        "usage": summarized["usage"],
    }


def compact_handler(
    read_json: Callable[[web.Request], Awaitable[dict[str, object]]],
) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        body = await read_json(request)
        result = await compact(request.app[LIFECYCLE_KEY].state, request.app[SERVICE_KEY], body)
        return json_response(result)

    return handle

"""``POST /v1/responses`` (and a WebSocket turn, ``websocket``): the conversation
(stored or remembered history, input items, instructions) becomes chat messages,
rendered with the chat template and run through the same pipeline as chat; its
lifecycle events, projected, are the stream, and the stored response is their fold.

``background: true`` answers at once (``queued``) while a task of the service runs the
response, which followers read live (``service.LiveRun``).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import orjson
import structlog

from sluice.events.recorder import Recording
from sluice.events.types import ErrorInfo
from sluice.http.admission import shutting_down
from sluice.http.errors import ApiError
from sluice.http.output import ResponseOutput
from sluice.http.projections.responses import ResponsesProjection, base_response
from sluice.http.protocol.response_items import Item, check_tool_outputs, to_chat_messages
from sluice.http.protocol.responses import ResponsesRequest, parse_responses_request
from sluice.http.routes.responses import compaction_item
from sluice.http.routes.responses.generation import (
    ID_PREFIX,
    Generation,
    IdMaker,
    Sink,
    frame,
    sse_sink,
)
from sluice.http.routes.responses.service import ROUTE, LiveRun, ResponsesService
from sluice.http.routes.serving import check_model, request_scope
from sluice.http.state import ServerState
from sluice.http.store import UNFINISHED
from sluice.pipeline.chat_job import ChatAsk, chat_job
from sluice.pipeline.errors import InvalidRequest
from sluice.pipeline.job import FieldNames, GenerationJob

log = structlog.get_logger("sluice.responses")
REPLAY_TASK_WAIT_S = 60.0
"""How long a replay waits for a background run (a recording cut short never ends)."""


class Memory(Protocol):
    """What a WebSocket connection keeps of its own responses (``store: false`` ones
    too), so that a turn continues from one without the store."""

    def recall(self, response_id: str) -> list[Item] | None: ...

    def remember(self, response_id: str, conversation: list[Item]) -> None: ...


@dataclass
class SocketTurn:
    """A response created over a WebSocket: where its events go, what it may continue."""

    sink: Sink
    memory: Memory
    status: str | None = None  # how the response ended, once it did


async def resolve_input(
    service: ResponsesService, given: Sequence[Item], ids: IdMaker
) -> list[Item]:
    """Input items with ids; an ``item_reference`` becomes the stored item it names."""
    items: list[Item] = []
    for index, item in enumerate(given):
        if item["type"] == "item_reference":
            found = await service.store.find_item(item["id"])
            if found is None:
                raise ApiError(
                    404, f"Item with id '{item['id'][:64]}' not found.", param=f"input[{index}].id"
                )
            items.append(found.item)
            continue
        if "id" not in item:
            item = {"id": ids(ID_PREFIX[item["type"]]), **item}
        items.append(item)
    return items


async def chat_messages(
    state: ServerState, service: ResponsesService, history: list[Item], inputs: list[Item]
) -> list[dict[str, object]]:
    """The conversation as chat messages, its tool outputs checked against its calls;
    compaction items are unsealed on the way (a tampered or foreign one is a 400)."""
    check_tool_outputs([*history, *inputs])
    summaries: dict[str, str] = {}
    if any(item["type"] == "compaction" for item in (*history, *inputs)):
        key = await service.compaction_key()
        summaries = compaction_item.summaries(key, state.model_name, history, inputs)
    return to_chat_messages([*history, *inputs], summaries)


def _previous_not_found(previous: str) -> ApiError:
    return ApiError(404, f"Previous response with id '{previous}' not found.",
                    param="previous_response_id", code="previous_response_not_found")  # fmt: skip


async def history_of(
    service: ResponsesService, previous: str | None, memory: Memory | None
) -> list[Item]:
    """The conversation ``previous`` ended: remembered by this WebSocket connection, or
    stored."""
    if previous is None:
        return []
    if memory is not None:
        remembered = memory.recall(previous)
        if remembered is not None:
            return remembered
    stored = await service.store.get(previous)
    if stored is None:
        raise _previous_not_found(previous)
    if stored.status in UNFINISHED:
        raise ApiError.bad_request(
            f"Previous response with id '{previous}' is still {stored.status}: wait for it "
            "to finish.",
            "previous_response_id",
        )
    conversation = await service.store.conversation(previous)
    if conversation is None:  # deleted meanwhile
        raise _previous_not_found(previous)
    return conversation


def _ask(
    req: ResponsesRequest, messages: list[dict[str, object]], response_id: str, created: int
) -> ChatAsk:
    return ChatAsk(
        request_id=response_id,
        created=created,
        model=req.model,
        messages=messages,
        sampling_for=req.sampling_for,
        max_tokens=req.max_output_tokens,
        names=FieldNames(prompt="input", max_tokens="max_output_tokens", constraint="text.format"),
        tools=req.tools,
        tool_choice=req.tool_choice,
        parallel_tool_calls=req.parallel_tool_calls,
        max_tool_calls=req.max_tool_calls,
        constraint=req.constraint,
        stop=req.stop,
        no_stop_trim=req.no_stop_trim,
        skip_special_tokens=req.skip_special_tokens,
        show_logprobs=req.include_logprobs,
        template_kwargs=req.chat_template_kwargs,
        reasoning_effort=req.reasoning_effort,
        truncate=req.truncation == "auto",
        routing_key=req.prompt_cache_key or req.user,
    )


async def _job(state: ServerState, ask: ChatAsk) -> GenerationJob:
    """The chat job; a context overflow says, unless truncation is on, that it is off."""
    if state.chat is None:
        raise InvalidRequest(
            "This model has no chat template: start the server with --chat-template.", "input"
        )
    try:
        return await chat_job(state.chat, state.pipeline, ask)
    except InvalidRequest as exc:
        if exc.code != "context_length_exceeded" or ask.truncate:
            raise
        raise InvalidRequest(
            f"{exc.message} (truncation is disabled)", exc.param, exc.code
        ) from None


async def run_responses(
    state: ServerState,
    body: Any,
    output: ResponseOutput,
    *,
    request_id: str | None = None,
    created: int | None = None,
    service: ResponsesService | None = None,
    clock: Callable[[], int] | None = None,
    socket: SocketTurn | None = None,
) -> None:
    """Serve one create request into ``output`` (or, over a WebSocket, into the turn's
    sink). Without a ``service`` (replay), a fresh in-memory store; ``clock`` gives
    ``completed_at`` (replay passes the recorded one)."""
    started = time.perf_counter()
    owned = service is None
    service = service or ResponsesService.in_memory()
    try:
        await _create(state, service, body, output, request_id, created, clock, started, socket)
        if owned:  # a replayed background response runs to its end before the replay ends
            with anyio.move_on_after(REPLAY_TASK_WAIT_S):
                await service.wait_for_tasks()
    finally:
        if owned:
            await service.close()


async def _create(
    state: ServerState,
    service: ResponsesService,
    body: Any,
    output: ResponseOutput,
    request_id: str | None,
    created: int | None,
    clock: Callable[[], int] | None,
    started: float,
    socket: SocketTurn | None,
) -> None:
    req = parse_responses_request(body)
    check_model(state, req.model)
    response_id = request_id or f"resp_{uuid.uuid4().hex}"
    created = created if created is not None else int(time.time())
    ids = IdMaker(response_id)
    memory = socket.memory if socket is not None else None
    history = await history_of(service, req.previous_response_id, memory)
    inputs = await resolve_input(service, req.input, ids)
    messages = await chat_messages(state, service, history, inputs)
    if req.instructions is not None:
        messages.insert(0, {"role": "system", "content": req.instructions})
    trace = log.bind(response_id=response_id, model=req.model, background=req.background,
                     stream=req.stream, store=req.store,
                     previous_response_id=req.previous_response_id)  # fmt: skip
    # A WebSocket turn shares its connection: it is not recorded (replay re-runs one
    # request's bytes), and logs its own lifecycle.
    scope_state = dataclasses.replace(state, recorder=None) if socket is not None else state
    async with request_scope(scope_state, ROUTE, body, output, response_id, created) as scope:
        job = await _job(state, _ask(req, messages, response_id, created))
        run = await scope.start(job)
        scope.stream = req.stream
        base = base_response(response_id, created, req.config(), background=req.background)
        projection = ResponsesProjection(
            base,
            new_id=ids,
            want_logprobs=req.include_logprobs,
            clock=clock or _clock(scope.recording),
        )
        gen = Generation(service, state, req, run, projection, response_id, started, trace)
        extra: dict[str, Any] = {}
        if service.trace_prompts:
            extra["input_text"] = [
                {"role": m["role"], "content": m.get("content")} for m in messages
            ]
        trace.info("response.created", status=base["status"], input_items=len(inputs),
                   history_items=len(history), prompt_tokens=len(run.prompt_ids[0]),
                   max_output_tokens=req.max_output_tokens, **extra)  # fmt: skip
        if req.store:
            await service.store.create(
                response_id,
                created_at=created,
                status=base["status"],
                background=req.background,
                body=orjson.dumps(base),
                history=history,
                input_items=inputs,
            )
        output = scope.output  # with a recorder, it keeps a copy of the bytes
        if socket is not None:
            await _stream(gen, socket.sink)
            body = projection.fold.body()
            socket.status = body["status"]
            # A stored response is read from the store (where a DELETE reaches it).
            if not req.store and body["status"] in ("completed", "incomplete"):
                socket.memory.remember(response_id, [*history, *inputs, *body["output"]])
        elif req.background:
            # The recording is saved once both the request and the run are over.
            save = scope.defer_save()
            await _start_background(gen, output, _after_both(save) if save else None)
        elif req.stream:
            await _stream(gen, sse_sink(output), output.start_stream)
        else:
            await _unary(gen, output)


def _after_both(save: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """``save`` on the second call: the request and its background run each call once."""
    left = 2

    async def one() -> None:
        nonlocal left
        left -= 1
        if left == 0:
            await save()

    return one


async def _admitted(
    gen: Generation, sink: Sink | None, start: Callable[[], Awaitable[None]] | None = None
) -> bool:
    """The response's events into ``sink`` once admitted (``start`` opens the stream
    then: a refusal before it is an HTTP error, not a stream). True when shutdown cut
    it short; its failure is published by then."""
    admission, metrics = gen.state.admission, gen.state.metrics
    async with admission.slots(1) as ticket:
        metrics.queue_time.observe(ticket.queued_s, ROUTE)
        if start is not None:
            await start()
        with ticket.scope:
            await gen.pump(sink)
        if ticket.scope.cancelled_caught:
            await gen.fail(shutting_down().to_info(), sink)
            return True
    return False


async def _foreground(
    gen: Generation, sink: Sink | None, start: Callable[[], Awaitable[None]] | None = None
) -> bool:
    """``_admitted`` for a client that waits: a response never admitted is not kept,
    one whose client went away is stored ``cancelled``."""
    try:
        return await _admitted(gen, sink, start)
    except ApiError:
        if not gen.projection.events:
            await gen.forget()
        raise
    except BaseException:
        if not gen.projection.terminal:
            await gen.cancelled("the client went away")
        raise


async def _stream(
    gen: Generation, write: Sink, start: Callable[[], Awaitable[None]] | None = None
) -> None:
    await _foreground(gen, write, start)
    if not gen.projection.terminal:
        await gen.cancelled("the stream ended early")


async def _unary(gen: Generation, output: ResponseOutput) -> None:
    if await _foreground(gen, None):
        raise shutting_down()
    if gen.error is not None:
        raise ApiError.from_info(gen.error)
    await output.finish_json(200, orjson.dumps(gen.projection.fold.body()))


async def _start_background(
    gen: Generation, output: ResponseOutput, save: Callable[[], Awaitable[None]] | None
) -> None:
    """Queue the response, run it in a task of the service, answer at once."""
    service, response_id = gen.service, gen.response_id
    live = LiveRun(gen.projection)
    service.live[response_id] = live

    async def publish(events: list[tuple[str, bytes]]) -> None:
        live.publish([frame(kind, data) for kind, data in events])

    await gen.publish(gen.projection.project([gen.run.created()]), publish)
    gen.trace.info("response.queued", status="queued")
    service.spawn(_background(gen, live, publish, save))
    try:
        if gen.req.stream:
            await output.start_stream()
            async for chunk in live.follow(-1):
                await output.write(chunk)
        else:
            await output.finish_json(200, orjson.dumps(gen.projection.fold.body()))
    finally:
        if save is not None:
            await save()


async def _background(
    gen: Generation, live: LiveRun, publish: Sink, save: Callable[[], Awaitable[None]] | None
) -> None:
    try:
        with anyio.CancelScope() as cancel:
            live.scope = cancel
            if live.cancel_requested:
                cancel.cancel()
            try:
                await _admitted(gen, publish)
            except ApiError as exc:  # not admitted: busy, or shutting down
                await gen.fail(exc.to_info(), publish)
            except Exception as exc:
                log.exception("background response failed", response_id=gen.response_id)
                await gen.fail(ErrorInfo(f"internal error: {exc}"), publish)
        if not gen.projection.terminal:
            await gen.cancelled("cancelled" if live.cancel_requested else "server shutdown")
    finally:
        live.finish()
        gen.service.live.pop(gen.response_id, None)
        if save is not None:
            await save()


# ------------------------------------------------------------------------- replay


def _clock(recording: Recording | None) -> Callable[[], int]:
    """Now, in whole seconds; recorded when the request is (replay gives it back)."""
    if recording is not None:
        return recording.read_clock
    return lambda: int(time.time())


def replay_options(recording: Recording) -> dict[str, Any]:
    """What a replay needs beyond the request: the clock readings the recording kept
    (``completed_at``), given back in order; past them (a scripted recording), its
    ``created``."""
    readings = iter(recording.clock)
    return {"clock": lambda: next(readings, recording.created)}

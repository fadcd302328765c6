"""``/v1/responses``: stateful responses over the chat pipeline.

* ``POST /v1/responses`` turns the conversation (stored history, input items,
  instructions) into chat messages, renders them with the chat template and runs the
  same pipeline as chat. Its lifecycle events, projected (``projections.responses``),
  are the stream; the stored response is their fold; the event log is kept with it.
* ``background: true`` answers at once (``queued``) while a task runs the response;
  ``GET ?stream=true`` follows that task live, or replays the stored log once it ended
  (or follows the log of a task another front end runs: ``responses_elsewhere``).
* ``GET`` / ``DELETE`` / ``POST …/cancel`` / ``GET …/input_items`` read and change the
  store (``http.store``), whose calls all run off the event loop.

Every lifecycle transition is one structlog line (``sluice.responses``) with the ids,
status, timings and token counts; prompt and output text only with ``--trace-prompts``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import orjson
import structlog
from aiohttp import web

from sluice.events.recorder import Recording
from sluice.events.types import ErrorInfo, Failed, LifecycleEvent
from sluice.http.admission import RETRY_AFTER_S, shutting_down
from sluice.http.errors import ApiError
from sluice.http.metrics import TokenTimer
from sluice.http.output import HttpOutput, ResponseOutput
from sluice.http.projections.responses import (
    TERMINAL_EVENTS,
    Event,
    ResponsesProjection,
    base_response,
)
from sluice.http.protocol.common import check_integer, show
from sluice.http.protocol.responses import (
    Item,
    ResponsesRequest,
    check_response_id,
    item_text,
    parse_responses_request,
    to_chat_messages,
)
from sluice.http.routes.responses_elsewhere import cancel_elsewhere, follow_logged
from sluice.http.routes.serving import check_model, request_scope
from sluice.http.state import LIFECYCLE_KEY, ServerState
from sluice.http.store import UNFINISHED, ResponseStore, SqliteResponseStore
from sluice.pipeline.chat import chat_prompt_ids
from sluice.pipeline.job import GenerationJob, Prompt
from sluice.pipeline.parse_fold import OutputParsing
from sluice.pipeline.runner import RequestRun
from sluice.pipeline.tokenize import check_context
from sluice.pipeline.tool_calling import ToolPlan, plan_tool_calls

ROUTE = "/v1/responses"
MAX_LIST_LIMIT = 100

log = structlog.get_logger("sluice.responses")

_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs"}  # fmt: skip


def frame(event_type: str, data: bytes) -> bytes:
    """One SSE event: ``event:`` names it (as ``data.type``), ``data:`` is its JSON."""
    return b"event: " + event_type.encode() + b"\ndata: " + data + b"\n\n"


def _frame_of(data: bytes) -> bytes:
    return frame(orjson.loads(data)["type"], data)


class IdMaker:
    """Item ids derived from the response id, so a replay names items the same way."""

    def __init__(self, response_id: str) -> None:
        self.stem = response_id.removeprefix("resp_")
        self.counts: dict[str, int] = {}

    def __call__(self, prefix: str) -> str:
        n = self.counts.get(prefix, 0)
        self.counts[prefix] = n + 1
        return f"{prefix}_{self.stem}{n:04x}"


# ------------------------------------------------------------------------ live runs


class LiveRun:
    """A background response while its task runs: the events so far, for followers."""

    def __init__(self, projection: ResponsesProjection) -> None:
        self.projection = projection
        self.frames: list[bytes] = []
        self.done = False
        self.scope: anyio.CancelScope | None = None
        self.cancel_requested = False
        self.finished = anyio.Event()
        self._changed = anyio.Event()

    def publish(self, frames: Sequence[bytes]) -> None:
        self.frames.extend(frames)
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    def finish(self) -> None:
        self.done = True
        self._changed.set()
        self.finished.set()

    async def follow(self, after: int) -> AsyncIterator[bytes]:
        """Frames whose sequence number is greater than ``after``, live until the end."""
        index = max(after + 1, 0)
        while True:
            if index < len(self.frames):
                chunk = b"".join(self.frames[index:])
                index = len(self.frames)
                yield chunk
            elif self.done:
                return
            else:
                await self._changed.wait()


@dataclass
class ResponsesService:
    """The store, the background tasks and the live runs of one server."""

    store: ResponseStore
    trace_prompts: bool = False
    live: dict[str, LiveRun] = field(default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @classmethod
    def in_memory(cls) -> ResponsesService:
        return cls(SqliteResponseStore(":memory:"))

    async def start(self) -> None:
        """Responses a previous process left unfinished can never finish: mark them."""

        def interrupted(body: bytes, next_seq: int) -> tuple[str, bytes, bytes]:
            data = orjson.loads(body)
            data["status"] = "failed"
            data["error"] = {
                "code": "server_error",
                "message": "The server restarted before the response finished.",
            }
            event = {"type": "response.failed", "sequence_number": next_seq, "response": data}
            return "failed", orjson.dumps(data), orjson.dumps(event)

        count = await self.store.interrupt_unfinished(interrupted)
        if count:
            log.warning("unfinished responses marked failed after a restart", count=count)
        await self.store.watch_cancels(self._cancel_relayed)

    def _cancel_relayed(self, response_id: str) -> None:
        """Another front end sharing the store was asked to cancel one of our runs."""
        live = self.live.get(response_id)
        if live is not None:
            self.spawn(_cancel_live(live))

    def spawn(self, work: Awaitable[None]) -> None:
        async def run() -> None:
            await work

        task = asyncio.get_running_loop().create_task(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=10)
        await self.store.close()


SERVICE_KEY = web.AppKey("sluice_responses", ResponsesService)


# --------------------------------------------------------------------------- create


@dataclass
class Generation:
    """One response being generated: pipeline run, projection, store and trace."""

    service: ResponsesService
    state: ServerState
    req: ResponsesRequest
    run: RequestRun
    projection: ResponsesProjection
    response_id: str
    started: float
    trace: Any
    recording: Recording | None = None
    error: ErrorInfo | None = None
    ttft: float | None = None

    @property
    def store(self) -> ResponseStore | None:
        return self.service.store if self.req.store else None

    def _seconds(self) -> float:
        return round(time.perf_counter() - self.started, 4)

    async def save(self) -> None:
        """The response as it stands (and, once it ended, its output items)."""
        if self.store is None:
            return
        body = self.projection.fold.response or self.projection.snapshot(self.projection.status)
        status = body["status"]
        final = status not in UNFINISHED
        await self.store.update(
            self.response_id,
            status=status,
            body=orjson.dumps(body),
            output_items=body["output"] if final else None,
        )

    async def publish(
        self, events: list[Event], sink: Callable[[list[bytes]], Awaitable[None]] | None
    ) -> None:
        """Log, store and hand on one batch of stream events."""
        if not events:
            return
        encoded = [orjson.dumps(e) for e in events]
        if self.store is not None:
            await self.store.append_events(
                self.response_id,
                [(e["sequence_number"], data) for e, data in zip(events, encoded, strict=True)],
            )
        for event in events:
            self._trace(event)
            if event["type"] in ("response.in_progress", *TERMINAL_EVENTS):
                await self.save()
        if sink is not None:
            await sink([frame(e["type"], d) for e, d in zip(events, encoded, strict=True)])

    def _trace(self, event: Event) -> None:
        kind = event["type"]
        if kind in ("response.output_text.delta", "response.reasoning_text.delta",
                    "response.function_call_arguments.delta"):  # fmt: skip
            if self.ttft is None:
                self.ttft = self._seconds()
                self.trace.info("response.first_token", seconds=self.ttft)
            return
        if kind == "response.in_progress":
            self.trace.info("response.in_progress", status="in_progress", seconds=self._seconds(),
                            prompt_tokens=len(self.run.prompt_ids[0]))  # fmt: skip
        elif kind == "response.output_item.done":
            item = event["item"]
            self.trace.info("response.output_item.done", item_id=item["id"], item_type=item["type"],
                            item_status=item.get("status"), seconds=self._seconds())  # fmt: skip
        elif kind == "error":
            self.trace.warning("response.error", message=event["message"], code=event["code"])
        elif kind in TERMINAL_EVENTS:
            body = event["response"]
            usage = body.get("usage") or {}
            extra = {}
            if self.service.trace_prompts:
                extra["output_text"] = "".join(item_text(i) for i in body["output"])
            self.trace.info(
                kind,
                status=body["status"],
                seconds=self._seconds(),
                ttft=self.ttft,
                input_tokens=usage.get("input_tokens"),
                cached_tokens=(usage.get("input_tokens_details") or {}).get("cached_tokens"),
                output_tokens=usage.get("output_tokens"),
                output_items=len(body["output"]),
                incomplete_reason=(body.get("incomplete_details") or {}).get("reason"),
                **extra,
            )

    async def pump(self, sink: Callable[[list[bytes]], Awaitable[None]] | None) -> None:
        """The pipeline's events, projected, until the response ends."""
        metrics, route = self.state.metrics, ROUTE
        timer = TokenTimer(metrics, route, self.started)
        async with self.run.events() as events:
            async for batch in events:
                timer.batch(batch)
                if self.recording is not None:
                    self.recording.lifecycle_events.extend(batch)
                failed = _failure(batch)
                if failed is not None:
                    self.error = failed
                await self.publish(self.projection.project(batch), sink)
                if self.projection.terminal:
                    return

    async def fail(
        self, error: ErrorInfo, sink: Callable[[list[bytes]], Awaitable[None]] | None
    ) -> None:
        self.error = error
        out: list[Event] = []
        self.projection.fail(out, error)
        await self.publish(out, sink)

    async def cancelled(self, reason: str) -> None:
        """The response ended without a terminal event (cancel, client gone)."""
        with anyio.CancelScope(shield=True):
            self.projection.cancelled()
            self.trace.info("response.cancelled", status="cancelled", reason=reason,
                            seconds=self._seconds())  # fmt: skip
            await self.save()

    async def forget(self) -> None:
        """Never admitted: the client gets the error and no response, so none is kept."""
        if self.store is not None:
            with anyio.CancelScope(shield=True):
                await self.store.delete(self.response_id)
        self.trace.info("response.not_admitted", seconds=self._seconds())


def _failure(batch: list[LifecycleEvent]) -> ErrorInfo | None:
    for event in batch:
        if isinstance(event, Failed):
            return event.error
    return None


async def _resolve_input(
    service: ResponsesService, req: ResponsesRequest, ids: IdMaker
) -> list[Item]:
    """Input items with ids; an ``item_reference`` becomes the stored item it names."""
    items: list[Item] = []
    for index, item in enumerate(req.input):
        if item["type"] == "item_reference":
            found = await service.store.find_item(item["id"])
            if found is None:
                raise ApiError(
                    404, f"Item with id '{item['id'][:64]}' not found.", param=f"input[{index}].id"
                )
            items.append(found.item)
            continue
        if "id" not in item:
            item = {"id": ids(_ID_PREFIX[item["type"]]), **item}
        items.append(item)
    return items


async def _history(service: ResponsesService, previous: str | None) -> list[Item]:
    if previous is None:
        return []
    stored = await service.store.get(previous)
    if stored is None:
        raise ApiError(404, f"Previous response with id '{previous}' not found.",
                       param="previous_response_id")  # fmt: skip
    if stored.status in UNFINISHED:
        raise ApiError.bad_request(
            f"Previous response with id '{previous}' is still {stored.status}: wait for it "
            "to finish.",
            "previous_response_id",
        )
    conversation = await service.store.conversation(previous)
    if conversation is None:  # deleted meanwhile
        raise ApiError(404, f"Previous response with id '{previous}' not found.",
                       param="previous_response_id")  # fmt: skip
    return conversation


def _output_parsing(
    state: ServerState, req: ResponsesRequest, plan: ToolPlan
) -> OutputParsing | None:
    """The server's reasoning parser and the plan's tool-call parser; ``max_tool_calls``
    (and ``parallel_tool_calls: false``) cap the calls kept."""
    limits = [n for n in (plan.max_calls, req.max_tool_calls) if n is not None]
    parsing = OutputParsing(
        reasoning_parser=state.chat.reasoning_parser if state.chat is not None else None,
        enable_thinking=req.chat_template_kwargs.get("enable_thinking") is not False,
        tool_parser=plan.parser,
        tool_schemas=plan.schemas,
        max_calls=min(limits) if limits else None,
    )
    return parsing if parsing.active else None


async def _prompt(
    state: ServerState, req: ResponsesRequest, messages: list[dict[str, object]]
) -> tuple[tuple[int, ...], int, ToolPlan]:
    """The prompt's ids, ``max_tokens`` and the tool plan (how tools reach the prompt,
    the grammar that forces calls, the parser); ``truncation: auto`` drops the oldest
    non-system messages until the prompt and the output fit the context."""
    context = state.pipeline.context_length
    if state.chat is None:
        raise ApiError.bad_request(
            "This model has no chat template: start the server with --chat-template.", "input"
        )
    while True:
        plan = plan_tool_calls(
            state.chat.tools if state.chat is not None else None,
            req.tools,
            req.tool_choice,
            parallel=req.parallel_tool_calls,
            messages=messages,
            has_constraint=req.constraint is not None,
        )
        ids = await chat_prompt_ids(
            state.chat,
            state.pipeline.tokenizer,
            plan.messages,
            template_kwargs=req.chat_template_kwargs,
            reasoning_effort=req.reasoning_effort,
            tools=plan.template_tools,
        )
        limit = req.max_output_tokens
        max_tokens = limit if limit is not None else max(context - len(ids), 0)
        fits = len(ids) < context and len(ids) + max_tokens <= context
        droppable = [i for i, m in enumerate(messages) if m["role"] != "system"]
        if fits or req.truncation != "auto" or len(droppable) <= 1:
            try:
                check_context(ids, max_tokens, context)
            except ApiError as exc:
                raise ApiError.bad_request(
                    exc.message + (" (truncation is disabled)" if req.truncation != "auto" else ""),
                    "input",
                    exc.code,
                ) from None
            return ids, max_tokens, plan
        del messages[droppable[0]]
        # A tool result without the call it answers means nothing: drop it too.
        while len(messages) > droppable[0] and messages[droppable[0]]["role"] == "tool":
            del messages[droppable[0]]


async def run_responses(
    state: ServerState,
    body: Any,
    output: ResponseOutput,
    *,
    request_id: str | None = None,
    created: int | None = None,
    service: ResponsesService | None = None,
    clock: Callable[[], int] | None = None,
) -> None:
    """Serve one create request into ``output``. Without a ``service`` (replay), a fresh
    in-memory store; ``clock`` gives ``completed_at`` (replay passes the recorded one)."""
    started = time.perf_counter()
    owned = service is None
    service = service or ResponsesService.in_memory()
    try:
        await _create(state, service, body, output, request_id, created, clock, started)
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
) -> None:
    req = parse_responses_request(body)
    check_model(state, req.model)
    response_id = request_id or f"resp_{uuid.uuid4().hex}"
    created = created if created is not None else int(time.time())
    ids = IdMaker(response_id)
    history = await _history(service, req.previous_response_id)
    inputs = await _resolve_input(service, req, ids)
    messages = to_chat_messages([*history, *inputs])
    if req.instructions is not None:
        messages.insert(0, {"role": "system", "content": req.instructions})
    trace = log.bind(response_id=response_id, model=req.model, background=req.background,
                     stream=req.stream, store=req.store,
                     previous_response_id=req.previous_response_id)  # fmt: skip
    # A background response outlives its request: it is not recorded (replay re-runs
    # one request's bytes), and it logs its own lifecycle.
    scope_state = dataclasses.replace(state, recorder=None) if req.background else state
    async with request_scope(scope_state, ROUTE, body, output, response_id, created) as scope:
        ids_prompt, max_tokens, plan = await _prompt(state, req, messages)
        sampling = req.sampling_for(max_tokens)
        constraint = plan.constraint or req.constraint
        if constraint is not None:
            sampling = replace(sampling, constraint=constraint)
        stops = req.stop
        if state.chat is not None:
            sampling = state.chat.with_stop_ids(sampling)
            stops = tuple(dict.fromkeys(stops + state.chat.stop_strings))
        job = GenerationJob(
            request_id=response_id,
            created=created,
            model=req.model,
            prompts=(Prompt(ids=ids_prompt),),
            sampling=sampling,
            stop=stops,
            no_stop_trim=req.no_stop_trim,
            # Tool-call markers may be special tokens: the parser must see them.
            skip_special_tokens=req.skip_special_tokens and plan.parser is None,
            show_logprobs=req.include_logprobs,
            parsing=_output_parsing(state, req, plan),
        )
        scope.choices, scope.stream = 1, req.stream
        run = RequestRun(state.pipeline, job, scope.recording)
        await run.prepare()
        base = base_response(response_id, created, req.config(), background=req.background)
        projection = ResponsesProjection(
            base,
            new_id=ids,
            want_logprobs=req.include_logprobs,
            clock=clock or (lambda: int(time.time())),
        )
        gen = Generation(service, state, req, run, projection, response_id, started, trace,
                         scope.recording)  # fmt: skip
        extra: dict[str, Any] = {}
        if service.trace_prompts:
            extra["input_text"] = [
                {"role": m["role"], "content": m.get("content")} for m in messages
            ]
        trace.info("response.created", status=base["status"], input_items=len(inputs),
                   history_items=len(history), prompt_tokens=len(ids_prompt),
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
        if req.background:
            await _start_background(gen, output)
        elif req.stream:
            await _stream(gen, output)
        else:
            await _unary(gen, output)


async def _stream(gen: Generation, output: ResponseOutput) -> None:
    admission, metrics = gen.state.admission, gen.state.metrics

    async def write(frames: list[bytes]) -> None:
        await output.write(b"".join(frames))

    try:
        async with admission.slots(1) as ticket:
            metrics.queue_time.observe(ticket.queued_s, ROUTE)
            await output.start_stream()
            with ticket.scope:
                await gen.pump(write)
            if ticket.scope.cancelled_caught:
                await gen.fail(shutting_down().to_info(), write)
    except ApiError:
        if not gen.projection.events:
            await gen.forget()
        raise
    except BaseException:
        if not gen.projection.terminal:
            await gen.cancelled("the client went away")
        raise
    if not gen.projection.terminal:
        await gen.cancelled("the stream ended early")


async def _unary(gen: Generation, output: ResponseOutput) -> None:
    admission, metrics = gen.state.admission, gen.state.metrics
    try:
        async with admission.slots(1) as ticket:
            metrics.queue_time.observe(ticket.queued_s, ROUTE)
            with ticket.scope:
                await gen.pump(None)
            if ticket.scope.cancelled_caught:
                await gen.fail(shutting_down().to_info(), None)
                raise shutting_down()
    except ApiError:
        if not gen.projection.events:
            await gen.forget()
        raise
    except BaseException:
        if not gen.projection.terminal:
            await gen.cancelled("the client went away")
        raise
    if gen.error is not None:
        raise ApiError.from_info(gen.error)
    await output.finish_json(200, orjson.dumps(gen.projection.fold.body()))


async def _start_background(gen: Generation, output: ResponseOutput) -> None:
    """Queue the response, run it in a task of the service, answer at once."""
    service, response_id = gen.service, gen.response_id
    live = LiveRun(gen.projection)
    service.live[response_id] = live

    async def publish(frames: list[bytes]) -> None:
        live.publish(frames)

    await gen.publish(gen.projection.open(), publish)
    gen.trace.info("response.queued", status="queued")
    service.spawn(_background(gen, live, publish))
    if gen.req.stream:
        await output.start_stream()
        async for chunk in live.follow(-1):
            await output.write(chunk)
    else:
        await output.finish_json(200, orjson.dumps(gen.projection.fold.body()))


async def _background(
    gen: Generation, live: LiveRun, publish: Callable[[list[bytes]], Awaitable[None]]
) -> None:
    admission, metrics = gen.state.admission, gen.state.metrics
    try:
        with anyio.CancelScope() as cancel:
            live.scope = cancel
            if live.cancel_requested:
                cancel.cancel()
            try:
                async with admission.slots(1) as ticket:
                    metrics.queue_time.observe(ticket.queued_s, ROUTE)
                    with ticket.scope:
                        await gen.pump(publish)
                    if ticket.scope.cancelled_caught:
                        await gen.fail(shutting_down().to_info(), publish)
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


# ------------------------------------------------------------------- other routes


def _response_id(request: web.Request) -> str:
    response_id = request.match_info["response_id"]
    check_response_id(response_id, "response_id")
    return response_id


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param="response_id")


def _json(body: Any) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json")


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
        return _json(live.projection.fold.response or live.projection.snapshot("queued"))
    output = HttpOutput(request)
    await output.start_stream()
    try:
        if live is not None:
            async for chunk in live.follow(after):
                await output.write(chunk)
        else:  # finished, or running on another front end that shares the store
            async for logged in follow_logged(service.store, response_id, after):
                await output.write(b"".join(_frame_of(data) for data in logged))
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
        await _cancel_live(live)
    if not await service.store.delete(response_id):
        raise _not_found(response_id)
    log.info("response.deleted", response_id=response_id)
    return _json({"id": response_id, "object": "response", "deleted": True})


async def _cancel_live(live: LiveRun) -> None:
    live.cancel_requested = True
    if live.scope is not None:
        live.scope.cancel()
    await live.finished.wait()


async def cancel_response(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    response_id = _response_id(request)
    _query(request, ())
    live = service.live.get(response_id)
    if live is not None:
        await _cancel_live(live)
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
    return _json({
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    })  # fmt: skip


def create_handler(
    read_json: Callable[[web.Request], Awaitable[dict[str, object]]],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        output = HttpOutput(request)
        state = request.app[LIFECYCLE_KEY].state
        try:
            await run_responses(state, body, output, service=request.app[SERVICE_KEY])
        except ConnectionError:
            if output.response is None:
                raise
        assert output.response is not None
        return output.response

    return handle


def register(
    app: web.Application,
    service: ResponsesService,
    read_json: Callable[[web.Request], Awaitable[dict[str, object]]],
) -> None:
    """The Responses routes, and the service's start (mark interrupted responses) and
    close (stop background tasks, close the store)."""
    app[SERVICE_KEY] = service

    async def on_startup(app: web.Application) -> None:
        await service.start()

    async def on_cleanup(app: web.Application) -> None:
        await service.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post(ROUTE, create_handler(read_json))
    app.router.add_get(ROUTE + "/{response_id}", get_response)
    app.router.add_delete(ROUTE + "/{response_id}", delete_response)
    app.router.add_post(ROUTE + "/{response_id}/cancel", cancel_response)
    app.router.add_get(ROUTE + "/{response_id}/input_items", list_input_items)


# ------------------------------------------------------------------------- replay


def replay_options(recording: Recording) -> dict[str, Any]:
    """What a replay needs beyond the request: the recorded ``completed_at`` (a clock
    reading, an input like ``created``)."""
    completed_at: int | None = None
    raw = recording.output
    try:
        if raw.startswith(b"event: "):
            for chunk in raw.split(b"\n\n"):
                data = chunk.partition(b"\ndata: ")[2]
                if data:
                    event = orjson.loads(data)
                    if event["type"] == "response.completed":
                        completed_at = event["response"]["completed_at"]
        elif recording.status == 200:
            completed_at = orjson.loads(raw).get("completed_at")
    except (orjson.JSONDecodeError, KeyError, AttributeError):
        completed_at = None
    stamp = completed_at if completed_at is not None else recording.created
    return {"clock": lambda: stamp}


__all__ = [
    "ROUTE",
    "SERVICE_KEY",
    "ResponsesService",
    "register",
    "replay_options",
    "run_responses",
]

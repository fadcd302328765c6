"""What every generation route does the same way: model check, recording, the
request log line, and pumping the pipeline's events into SSE or a unary fold."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import orjson
import structlog

from sluice.events.recorder import Recording
from sluice.events.types import Completed, Failed, Incomplete, LifecycleEvent, Usage, terminal_of
from sluice.http.admission import shutting_down
from sluice.http.errors import ApiError, error_body
from sluice.http.metrics import TokenTimer
from sluice.http.output import RecordingOutput, ResponseOutput
from sluice.http.projections.base import Chunk
from sluice.http.sse import DONE, data_frame, data_frames
from sluice.http.state import ServerState
from sluice.pipeline.errors import InvalidRequest
from sluice.pipeline.job import GenerationJob
from sluice.pipeline.runner import RequestRun


class Projection(Protocol):
    """Turns batches of lifecycle events into API chunks (see ``http.projections``)."""

    usage: Usage | None

    def project(self, batch: list[LifecycleEvent]) -> list[Chunk]: ...

    def usage_chunk(self) -> Chunk: ...


def check_model(state: ServerState, model: str) -> None:
    """SGLang's (Rust server's) convention on generation routes: 400, naming the model."""
    if model != state.model_name:
        raise ApiError(
            400,
            f"The model `{model}` does not exist. The served model name is `{state.model_name}`.",
            param="model",
            code="model_not_found",
        )


@dataclass
class RequestScope:
    output: ResponseOutput
    recording: Recording | None
    state: ServerState
    route: str
    started: float  # perf_counter() when the request began
    projection: Projection | None = None
    choices: int = 0
    stream: bool = False
    save_deferred: bool = False

    def defer_save(self) -> Callable[[], Awaitable[None]] | None:
        """For a run that outlives its request (a background response): the scope does
        not save the recording when the request ends; the returned call does (with the
        bytes the request sent so far), once the run is over. None when nothing is
        recorded."""
        recording, recorder, output = self.recording, self.state.recorder, self.output
        if recording is None or recorder is None:
            return None
        self.save_deferred = True

        async def save() -> None:
            if isinstance(output, RecordingOutput):
                output.settle()
            with anyio.CancelScope(shield=True):
                await recorder.save(recording)

        return save

    async def start(self, job: GenerationJob) -> RequestRun:
        """The request's run of ``job``, its prompts tokenized (the 400s of the tokenize
        stage are raised here, inside the scope that records and logs them)."""
        self.choices = job.choices
        run = RequestRun(self.state.pipeline, job, self.recording)
        await run.prepare()
        return run


@asynccontextmanager
async def request_scope(
    state: ServerState,
    route: str,
    body: Any,
    output: ResponseOutput,
    request_id: str,
    created: int,
) -> AsyncIterator[RequestScope]:
    """Records the request when asked, and logs one line when it ends, however it ends."""
    recording = None
    if state.recorder is not None:
        recording = Recording(
            route, body, request_id, created, state.model_name, state.pipeline.context_length
        )
        if state.chat is not None:
            recording.server = dict(state.chat.flags)
        output = RecordingOutput(output, recording)
    started = time.perf_counter()
    scope = RequestScope(output, recording, state, route, started)
    log = structlog.get_logger("sluice.request").bind(request_id=request_id, route=route)
    outcome = "cancelled"  # unless we get to say otherwise: the client went away
    try:
        try:
            yield scope
        except InvalidRequest as exc:  # the pipeline's refusal, answered as HTTP's
            raise ApiError.bad_request(exc.message, exc.param, exc.code) from None
        outcome = "ok"
    except ApiError as exc:
        outcome = f"error {exc.status}"
        if recording is not None:
            recording.status, recording.output = exc.status, exc.json()
        raise
    finally:
        seconds = time.perf_counter() - started
        if outcome == "ok":
            state.metrics.e2e.observe(seconds, route)
        usage = scope.projection.usage if scope.projection is not None else None
        log.info(
            "request done",
            outcome=outcome,
            stream=scope.stream,
            choices=scope.choices,
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None,
            cached_tokens=usage.cached_tokens if usage else None,
            seconds=round(seconds, 4),
        )
        if recording is not None and state.recorder is not None:
            if isinstance(output, RecordingOutput):
                output.settle()
            if not scope.save_deferred:
                # Shielded: a client that disconnected still leaves its recording behind.
                with anyio.CancelScope(shield=True):
                    await state.recorder.save(recording)


async def stream_sse(
    run: RequestRun,
    projection: Projection,
    scope: RequestScope,
    timer: TokenTimer,
    *,
    include_usage: bool,
) -> None:
    """One SSE write per engine step; a mid-stream failure is one ``data: {"error"}``."""
    output = scope.output
    await output.start_stream()

    async def write(batch: list[LifecycleEvent]) -> None:
        timer.batch(batch)
        data = data_frames(projection.project(batch))
        end = terminal_of(batch)
        if isinstance(end, Failed):
            data += data_frame(error_body(end.error))
        elif isinstance(end, Completed | Incomplete):
            if include_usage:
                data += data_frame(projection.usage_chunk())
            data += DONE
        if data:
            await output.write(data)

    await run.pump(write)


async def collect_chunks(
    run: RequestRun, projection: Projection, scope: RequestScope, timer: TokenTimer
) -> list[Chunk]:
    """Every chunk the stream would have sent, for the unary fold."""
    chunks: list[Chunk] = []

    async def collect(batch: list[LifecycleEvent]) -> None:
        timer.batch(batch)
        chunks.extend(projection.project(batch))

    end = await run.pump(collect)
    if isinstance(end, Failed):
        raise ApiError.from_info(end.error)
    return chunks


async def respond(
    run: RequestRun,
    projection: Projection,
    scope: RequestScope,
    *,
    stream: bool,
    include_usage: bool,
    fold: Callable[[list[Chunk], Usage | None], dict[str, Any] | list[Any]],
) -> None:
    """Stream the projection as SSE, or send the unary body: ``fold`` of its chunks.

    The request holds its admission slots while its events flow (``http.admission``),
    and is findable by its id (``/abort_request``) until it ends.
    """
    scope.projection, scope.stream = projection, stream
    metrics, route = scope.state.metrics, scope.route
    timer = TokenTimer(metrics, route, scope.started)
    with scope.state.active.track(run.job.request_id):
        async with scope.state.admission.slots(run.job.choices) as ticket:
            metrics.queue_time.observe(ticket.queued_s, route)
            try:
                with ticket.scope:
                    if stream:
                        await stream_sse(run, projection, scope, timer, include_usage=include_usage)
                        return
                    chunks = await collect_chunks(run, projection, scope, timer)
            except BaseException:
                run.cancel("the client went away")
                raise
            if ticket.scope.cancelled_caught:
                # Shutdown ran out of patience: a stream ends with the error, unary a 503.
                run.fail(shutting_down().to_info())
                if not stream:
                    raise shutting_down()
                await scope.output.write(data_frame(shutting_down().body()))
                return
    await scope.output.finish_json(200, orjson.dumps(fold(chunks, projection.usage)))

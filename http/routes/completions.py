"""``POST /v1/completions``: validate, run the pipeline, project the events."""

from __future__ import annotations

import time
import uuid
from typing import Any

import anyio
import orjson
import structlog

from sluice.events.recorder import Recording
from sluice.events.types import Completed, Failed, LifecycleEvent
from sluice.http.errors import ApiError, error_body
from sluice.http.output import RecordingOutput, ResponseOutput
from sluice.http.projections.completions import (
    Chunk,
    CompletionStream,
    fold_chunks,
    select_best_of,
)
from sluice.http.protocol.completions import CompletionRequest, parse_completion_request
from sluice.http.sse import DONE, data_frame, data_frames
from sluice.http.state import ServerState
from sluice.pipeline.job import GenerationJob, Prompt
from sluice.pipeline.runner import RequestRun

ROUTE = "/v1/completions"


def check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise ApiError(
            400,
            f"The model `{model}` does not exist. The served model name is `{state.model_name}`.",
            param="model",
            code="model_not_found",
        )


def _job(req: CompletionRequest, request_id: str, created: int) -> GenerationJob:
    sampling = req.sampling
    n = req.n
    show = req.logprobs is not None
    if req.best_of is not None and req.best_of > req.n:
        # Rank candidates by cumulative logprob: the engine must compute them.
        n = req.best_of
        if sampling.logprobs is None:
            sampling = _with_logprobs(sampling)
        show = True
    prompts = tuple(Prompt(text=p) if isinstance(p, str) else Prompt(ids=p) for p in req.prompts)
    return GenerationJob(
        request_id=request_id,
        created=created,
        model=req.model,
        prompts=prompts,
        sampling=sampling,
        n=n,
        stop=req.stop,
        no_stop_trim=req.no_stop_trim,
        skip_special_tokens=req.skip_special_tokens,
        echo=req.echo,
        show_logprobs=show,
    )


def _with_logprobs(sampling: Any) -> Any:
    from dataclasses import replace

    return replace(sampling, logprobs=0)


async def run_completion(
    state: ServerState,
    body: Any,
    output: ResponseOutput,
    *,
    request_id: str | None = None,
    created: int | None = None,
) -> None:
    """Serve one completions request into ``output`` (an HTTP response or a buffer)."""
    req = parse_completion_request(body)
    check_model(state, req.model)
    request_id = request_id or f"cmpl-{uuid.uuid4().hex}"
    created = created if created is not None else int(time.time())
    recording = None
    if state.recorder is not None:
        recording = Recording(
            ROUTE, body, request_id, created, state.model_name, state.pipeline.context_length
        )
        output = RecordingOutput(output, recording)
    log = structlog.get_logger("sluice.request").bind(request_id=request_id, route=ROUTE)
    started = time.perf_counter()
    outcome = "cancelled"  # unless we get to say otherwise: the client went away
    stream: CompletionStream | None = None
    try:
        job = _job(req, request_id, created)
        run = RequestRun(state.pipeline, job, recording)
        await run.prepare()
        stream = CompletionStream(
            request_id,
            created,
            req.model,
            want_logprobs=job.show_logprobs,
            continuous_usage=req.stream and req.continuous_usage_stats,
        )
        if req.stream:
            await _stream(run, stream, req, output, recording)
        else:
            await _unary(run, stream, req, output, recording)
        outcome = "ok"
    except ApiError as exc:
        outcome = f"error {exc.status}"
        if recording is not None:
            recording.status, recording.output = exc.status, exc.json()
        raise
    finally:
        usage = stream.usage if stream is not None else None
        log.info(
            "request done",
            outcome=outcome,
            stream=req.stream,
            choices=len(req.prompts) * req.n,
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None,
            cached_tokens=usage.cached_tokens if usage else None,
            seconds=round(time.perf_counter() - started, 4),
        )
        if recording is not None and state.recorder is not None:
            # Shielded: a client that disconnected still leaves its recording behind.
            with anyio.CancelScope(shield=True):
                await state.recorder.save(recording)


async def _stream(
    run: RequestRun,
    stream: CompletionStream,
    req: CompletionRequest,
    output: ResponseOutput,
    recording: Recording | None,
) -> None:
    await output.start_stream()
    async with run.events() as events:
        async for batch in events:
            if recording is not None:
                recording.lifecycle_events.extend(batch)
            data = data_frames(stream.project(batch))
            end = _terminal(batch)
            if isinstance(end, Failed):
                await output.write(data + data_frame(error_body(end.error)))
                return
            if isinstance(end, Completed):
                if req.include_usage:
                    data += data_frame(stream.usage_chunk())
                await output.write(data + DONE)
                return
            if data:
                await output.write(data)


async def _unary(
    run: RequestRun,
    stream: CompletionStream,
    req: CompletionRequest,
    output: ResponseOutput,
    recording: Recording | None,
) -> None:
    chunks: list[Chunk] = []
    async with run.events() as events:
        async for batch in events:
            if recording is not None:
                recording.lifecycle_events.extend(batch)
            chunks.extend(stream.project(batch))
            end = _terminal(batch)
            if isinstance(end, Failed):
                raise ApiError.from_info(end.error)
            if isinstance(end, Completed):
                break
    body = fold_chunks(chunks, stream.usage)
    if req.best_of is not None and req.best_of > req.n:
        body = select_best_of(
            body, n=req.n, best_of=req.best_of, keep_logprobs=req.logprobs is not None
        )
    await output.finish_json(200, orjson.dumps(body))


def _terminal(batch: list[LifecycleEvent]) -> Completed | Failed | None:
    for event in batch:
        if isinstance(event, Completed | Failed):
            return event
    return None

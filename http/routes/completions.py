"""``POST /v1/completions``: validate, run the pipeline, project the events."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

from sluice.events.types import Usage
from sluice.http.output import ResponseOutput
from sluice.http.projections.base import Chunk
from sluice.http.projections.completions import CompletionStream, fold_chunks, select_best_of
from sluice.http.protocol.completions import CompletionRequest, parse_completion_request
from sluice.http.protocol.structured import COMPLETION_FIELDS, constraint_field
from sluice.http.routes.serving import check_model, request_scope, respond
from sluice.http.state import ServerState
from sluice.pipeline.job import FieldNames, GenerationJob, Prompt

ROUTE = "/v1/completions"


def _job(req: CompletionRequest, request_id: str, created: int, body: Any) -> GenerationJob:
    sampling = req.sampling
    n = req.n
    show = req.logprobs is not None
    if req.best_of is not None and req.best_of > req.n:
        # Rank candidates by cumulative logprob: the engine must compute them.
        n = req.best_of
        if sampling.logprobs is None:
            sampling = replace(sampling, logprobs=0)
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
        routing_key=req.prompt_cache_key or req.user,
        names=FieldNames(constraint=constraint_field(body, COMPLETION_FIELDS)),
    )


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
    async with request_scope(state, ROUTE, body, output, request_id, created) as scope:
        job = _job(req, request_id, created, body)
        run = await scope.start(job)
        projection = CompletionStream(
            request_id,
            created,
            req.model,
            want_logprobs=job.show_logprobs,
            continuous_usage=req.stream and req.continuous_usage_stats,
        )

        def fold(chunks: list[Chunk], usage: Usage | None) -> dict[str, Any]:
            body = fold_chunks(chunks, usage)
            if req.best_of is not None and req.best_of > req.n:
                keep = req.logprobs is not None
                body = select_best_of(body, n=req.n, best_of=req.best_of, keep_logprobs=keep)
            return body

        await respond(
            run, projection, scope, stream=req.stream, include_usage=req.include_usage, fold=fold
        )

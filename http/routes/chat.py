"""``POST /v1/chat/completions``: messages through the chat template, then the same
pipeline as completions, projected as chat chunks."""

from __future__ import annotations

import time
import uuid
from typing import Any

from sluice.http.output import ResponseOutput
from sluice.http.projections.chat import ChatStream, fold_chat_chunks
from sluice.http.protocol.chat import ChatRequest, parse_chat_request
from sluice.http.protocol.structured import constraint_field
from sluice.http.routes.serving import check_model, request_scope, respond
from sluice.http.state import ServerState
from sluice.pipeline.chat_job import ChatAsk, chat_job
from sluice.pipeline.job import FieldNames

ROUTE = "/v1/chat/completions"


def _ask(req: ChatRequest, request_id: str, created: int, body: Any) -> ChatAsk:
    return ChatAsk(
        request_id=request_id,
        created=created,
        model=req.model,
        messages=req.messages,
        sampling_for=req.sampling_for,
        max_tokens=req.max_tokens,
        names=FieldNames(
            prompt="messages", max_tokens=req.max_tokens_name, constraint=constraint_field(body)
        ),
        tools=req.tools,
        tool_choice=req.tool_choice,
        parallel_tool_calls=req.parallel_tool_calls,
        constraint=req.base_sampling.constraint,
        stop=req.stop,
        no_stop_trim=req.no_stop_trim,
        skip_special_tokens=req.skip_special_tokens,
        show_logprobs=req.logprobs,
        n=req.n,
        continue_final_message=req.continue_final_message,
        template_kwargs=req.chat_template_kwargs,
        reasoning_effort=req.reasoning_effort,
        separate_reasoning=req.separate_reasoning,
        stream_reasoning=req.stream_reasoning,
        routing_key=req.prompt_cache_key or req.user,
    )


async def run_chat(
    state: ServerState,
    body: Any,
    output: ResponseOutput,
    *,
    request_id: str | None = None,
    created: int | None = None,
) -> None:
    """Serve one chat request into ``output`` (an HTTP response or a buffer)."""
    req = parse_chat_request(body)
    check_model(state, req.model)
    request_id = request_id or f"chatcmpl-{uuid.uuid4().hex}"
    created = created if created is not None else int(time.time())
    async with request_scope(state, ROUTE, body, output, request_id, created) as scope:
        job = await chat_job(state.chat, state.pipeline, _ask(req, request_id, created, body))
        run = await scope.start(job)
        projection = ChatStream(
            request_id,
            created,
            req.model,
            want_logprobs=req.logprobs,
            continuous_usage=req.stream and req.continuous_usage_stats,
        )
        await respond(
            run,
            projection,
            scope,
            stream=req.stream,
            include_usage=req.include_usage,
            fold=fold_chat_chunks,
        )

"""``POST /v1/chat/completions``: messages through the chat template, then the same
pipeline as completions, projected as chat chunks."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

from sluice.http.output import ResponseOutput
from sluice.http.projections.chat import ChatStream, fold_chat_chunks
from sluice.http.protocol.chat import ChatRequest, parse_chat_request
from sluice.http.routes.serving import check_model, request_scope, respond
from sluice.http.state import ServerState
from sluice.pipeline.chat import chat_prompt_ids
from sluice.pipeline.job import GenerationJob, Prompt
from sluice.pipeline.parse_fold import OutputParsing
from sluice.pipeline.tokenize import check_context
from sluice.pipeline.tool_calling import ToolPlan, plan_tool_calls

ROUTE = "/v1/chat/completions"


async def _job(
    state: ServerState, req: ChatRequest, request_id: str, created: int
) -> GenerationJob:
    tokenizer = state.pipeline.tokenizer
    plan = plan_tool_calls(
        state.chat.tools if state.chat is not None else None,
        req.tools,
        req.tool_choice,
        parallel=req.parallel_tool_calls,
        messages=req.messages,
        has_constraint=req.base_sampling.constraint is not None,
    )
    ids = await chat_prompt_ids(
        state.chat,
        tokenizer,
        plan.messages,
        continue_final_message=req.continue_final_message,
        template_kwargs=req.chat_template_kwargs,
        reasoning_effort=req.reasoning_effort,
        tools=plan.template_tools,
    )
    context = state.pipeline.context_length
    # No client limit: generate up to the context, as SGLang does.
    max_tokens = req.max_tokens if req.max_tokens is not None else max(context - len(ids), 0)
    check_context(ids, max_tokens, context)
    sampling = req.sampling_for(max_tokens)
    if plan.constraint is not None:
        sampling = replace(sampling, constraint=plan.constraint)
    stops = req.stop
    if state.chat is not None:
        sampling = state.chat.with_stop_ids(sampling)
        stops = tuple(dict.fromkeys(stops + state.chat.stop_strings))
    return GenerationJob(
        request_id=request_id,
        created=created,
        model=req.model,
        prompts=(Prompt(ids=ids),),
        sampling=sampling,
        n=req.n,
        stop=stops,
        no_stop_trim=req.no_stop_trim,
        # Tool-call markers may be special tokens: the parser must see them (as SGLang).
        skip_special_tokens=req.skip_special_tokens and plan.parser is None,
        show_logprobs=req.logprobs,
        parsing=_output_parsing(state, req, plan),
    )


def _output_parsing(state: ServerState, req: ChatRequest, plan: ToolPlan) -> OutputParsing | None:
    """The reasoning parser (unless the request keeps reasoning inline) and the plan's
    tool-call parser."""
    reasoning = state.chat.reasoning_parser if state.chat is not None else None
    if not req.separate_reasoning:
        reasoning = None
    parsing = OutputParsing(
        reasoning_parser=reasoning,
        stream_reasoning=req.stream_reasoning,
        enable_thinking=req.chat_template_kwargs.get("enable_thinking") is not False,
        tool_parser=plan.parser,
        tool_schemas=plan.schemas,
        max_calls=plan.max_calls,
    )
    return parsing if parsing.active else None


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
        job = await _job(state, req, request_id, created)
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

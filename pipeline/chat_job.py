"""One chat-shaped request as a generation job, for chat completions and Responses
alike: the tool plan, the prompt rendered by the chat template, ``max_tokens``, the
template's stop strings and ids, and how the output is parsed."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from sluice.engine.params import Constraint, SamplingParams

from .chat import ChatSetup, chat_prompt_ids
from .job import CHAT_NAMES, FieldNames, GenerationJob, Prompt
from .parse_fold import OutputParsing
from .runner import PipelineContext
from .tokenize import check_context
from .tool_calling import FunctionTool, ToolChoice, plan_tool_calls


@dataclass(frozen=True, slots=True)
class ChatAsk:
    """What the request asks, in the pipeline's terms."""

    request_id: str
    created: int
    model: str
    messages: Sequence[Mapping[str, object]]
    # The request's sampling once ``max_tokens`` is known (it may refuse: min_tokens).
    sampling_for: Callable[[int], SamplingParams]
    max_tokens: int | None  # None: up to the context, as SGLang does
    tools: Sequence[FunctionTool] = ()
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None
    # The request's own output constraint (a forced tool call's grammar replaces it).
    constraint: Constraint | None = None
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    show_logprobs: bool = False
    n: int = 1
    continue_final_message: bool = False
    template_kwargs: Mapping[str, object] = field(default_factory=dict)
    reasoning_effort: str | None = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # Drop the oldest non-system messages until the prompt and the output fit.
    truncate: bool = False
    routing_key: str | None = None
    names: FieldNames = CHAT_NAMES


async def chat_job(
    setup: ChatSetup | None, pipeline: PipelineContext, ask: ChatAsk
) -> GenerationJob:
    """The job; ``InvalidRequest`` for what cannot run (template errors, tool plans
    that cannot be honoured, a prompt beyond the context)."""
    messages = list(ask.messages)
    context = pipeline.context_length
    while True:
        plan = plan_tool_calls(
            setup.tools if setup is not None else None,
            ask.tools,
            ask.tool_choice,
            parallel=ask.parallel_tool_calls,
            messages=messages,
            has_constraint=ask.constraint is not None,
        )
        ids = await chat_prompt_ids(
            setup,
            pipeline.tokenizer,
            plan.messages,
            continue_final_message=ask.continue_final_message,
            template_kwargs=ask.template_kwargs,
            reasoning_effort=ask.reasoning_effort,
            tools=plan.template_tools,
        )
        max_tokens = ask.max_tokens if ask.max_tokens is not None else max(context - len(ids), 0)
        fits = len(ids) < context and len(ids) + max_tokens <= context
        droppable = [i for i, m in enumerate(messages) if m["role"] != "system"]
        if fits or not ask.truncate or len(droppable) <= 1:
            check_context(ids, max_tokens, context, ask.names)
            break
        del messages[droppable[0]]
        # A tool result without the call it answers means nothing: drop it too.
        while len(messages) > droppable[0] and messages[droppable[0]]["role"] == "tool":
            del messages[droppable[0]]
    sampling = ask.sampling_for(max_tokens)
    constraint = plan.constraint or ask.constraint
    if constraint is not None:
        sampling = replace(sampling, constraint=constraint)
    # A forced tool call's grammar is made of the request's tool schemas.
    names = replace(ask.names, constraint="tools") if plan.constraint else ask.names
    stops = ask.stop
    if setup is not None:
        sampling = setup.with_stop_ids(sampling)
        stops = tuple(dict.fromkeys(stops + setup.stop_strings))
    limits = [n for n in (plan.max_calls, ask.max_tool_calls) if n is not None]
    parsing = OutputParsing(
        reasoning_parser=setup.reasoning_parser
        if setup is not None and ask.separate_reasoning
        else None,
        stream_reasoning=ask.stream_reasoning,
        enable_thinking=ask.template_kwargs.get("enable_thinking") is not False,
        tool_parser=plan.parser,
        tool_schemas=plan.schemas,
        max_calls=min(limits) if limits else None,
    )
    return GenerationJob(
        request_id=ask.request_id,
        created=ask.created,
        model=ask.model,
        prompts=(Prompt(ids=ids),),
        sampling=sampling,
        n=ask.n,
        stop=stops,
        no_stop_trim=ask.no_stop_trim,
        # Tool-call markers may be special tokens: the parser must see them (as SGLang).
        skip_special_tokens=ask.skip_special_tokens and plan.parser is None,
        show_logprobs=ask.show_logprobs,
        parsing=parsing if parsing.active else None,
        routing_key=ask.routing_key,
        names=names,
    )

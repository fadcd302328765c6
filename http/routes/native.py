"""SGLang's native worker API beside the OpenAI routes, so that SGLang's model gateway
(SMG) and SGLang's own clients can use a Sluice server as a worker.

``POST /generate`` runs the same pipeline as completions; the rest report on the server
(``/server_info``, ``/model_info``, ``/v1/loads``), check it (``/health_generate``), or
act on it (``/flush_cache``, ``/abort_request``, ``/tokenize``, ``/detokenize``).
Shapes follow SGLang's ``http_server.py`` and what SMG reads of them; no response
carries a filesystem path (``model_path`` is the served name, as ``root`` is).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import anyio
from aiohttp import web

from sluice import __version__
from sluice.engine.interface import EngineStats, WorkerStats
from sluice.engine.params import SamplingParams
from sluice.events.types import Completed, Incomplete, LifecycleEvent, Usage
from sluice.http.body import ReadJson
from sluice.http.errors import ApiError
from sluice.http.output import ResponseOutput, json_response
from sluice.http.projections.base import Chunk
from sluice.http.projections.generate import GenerateStream, LogprobView
from sluice.http.protocol.fields import Fields, type_error
from sluice.http.protocol.generate import UNKNOWN_MODEL, GenerateRequest, parse_generate_request
from sluice.http.protocol.structured import COMPLETION_FIELDS, constraint_field
from sluice.http.routes.serving import check_model, request_scope, respond
from sluice.http.state import LIFECYCLE_KEY, ServerState
from sluice.pipeline.job import FieldNames, GenerationJob, Prompt
from sluice.pipeline.prompt_bounds import TokenReach, refuse_unfit, token_reach
from sluice.pipeline.runner import RequestRun
from sluice.pipeline.tokenize import INLINE_CHARS

ROUTE = "/generate"
HEALTH_TIMEOUT_S = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT
LOAD_SECTIONS = frozenset({"core", "all"})
"""``/v1/loads?include=``: the sections Sluice has (one engine: no disaggregation,
speculative, LoRA or memory breakdowns)."""
OTHER_FIELDS_BYTES = 64 << 10
"""Room in a ``/tokenize`` or ``/detokenize`` body beside its prompts or ids: the other
fields, and the quotes and commas of a batch."""
ID_JSON_BYTES = 32
"""The most one token id takes in a ``/detokenize`` body: its digits, a comma and the
indentation of a pretty-printed nested array."""


def _job(
    req: GenerateRequest, request_id: str, created: int, model: str, body: Any
) -> GenerationJob:
    prompts = tuple(Prompt(text=p) if isinstance(p, str) else Prompt(ids=p) for p in req.prompts)
    return GenerationJob(
        request_id=request_id,
        created=created,
        model=model,
        prompts=prompts,
        sampling=req.sampling,
        n=req.n,
        stop=req.stop,
        no_stop_trim=req.no_stop_trim,
        skip_special_tokens=req.skip_special_tokens,
        # The prompt's logprobs travel on the echo delta; its text is not shown.
        echo=req.logprob_start_len is not None,
        show_logprobs=req.return_logprob,
        show_token_ids=True,
        names=FieldNames(
            prompt="text" if isinstance(req.prompts[0], str) else "input_ids",
            max_tokens="sampling_params.max_new_tokens",
            sampling_prefix="sampling_params.",
            constraint="sampling_params."
            + constraint_field(body.get("sampling_params"), COMPLETION_FIELDS),
        ),
    )


async def run_generate(
    state: ServerState,
    body: Any,
    output: ResponseOutput,
    *,
    request_id: str | None = None,
    created: int | None = None,
) -> None:
    """Serve one ``/generate`` request into ``output`` (an HTTP response or a buffer)."""
    req = parse_generate_request(body)
    # SGLang's /generate names no model; SMG sends "unknown" when the client gave none.
    if req.model not in (None, UNKNOWN_MODEL):
        check_model(state, req.model)
    request_id = request_id or req.rid or uuid.uuid4().hex
    created = created if created is not None else int(time.time())
    async with request_scope(state, ROUTE, body, output, request_id, created) as scope:
        job = _job(req, request_id, created, state.model_name, body)
        run = await scope.start(job)
        view = None
        if req.return_logprob:
            view = LogprobView(req.top_logprobs_num, req.return_text_in_logprobs,
                               req.logprob_start_len)  # fmt: skip
        projection = GenerateStream(request_id, batch=req.batch, stream=req.stream, logprobs=view)

        def fold(chunks: list[Chunk], usage: Usage | None) -> Any:
            return projection.unary_body()

        await respond(run, projection, scope, stream=req.stream, include_usage=False, fold=fold)


# ----------------------------------------------------------------------- reports


def _state(request: web.Request) -> ServerState:
    return request.app[LIFECYCLE_KEY].state


def model_info(state: ServerState) -> dict[str, Any]:
    chat = state.chat
    facts = state.facts
    return {
        "model_path": state.model_name,
        "served_model_name": state.model_name,
        "tokenizer_path": state.model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "reasoning_parser": chat.reasoning_parser if chat is not None else None,
        "tool_call_parser": chat.tools.parser if chat is not None else None,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": None,
        "architectures": [facts.architecture] if facts is not None else None,
    }


def _ranks(stats: EngineStats) -> tuple[WorkerStats, ...]:
    """Each engine's numbers by rank; one engine in this process is rank 0."""
    return stats.workers or (
        WorkerStats(0, True, stats.running, stats.waiting, 0, stats.prompt_tokens,
                    stats.cached_tokens),
    )  # fmt: skip


def server_info(state: ServerState) -> dict[str, Any]:
    stats = state.pipeline.engine.stats()
    workers = _ranks(stats)
    return {
        "tp_size": 1,
        "pp_size": 1,
        "dp_size": len(workers),
        **state.settings,
        "model_path": state.model_name,
        "served_model_name": state.model_name,
        "tokenizer_path": state.model_name,
        "context_length": state.pipeline.context_length,
        "max_running_requests": state.admission.max_running,
        "internal_states": [
            {"dp_rank": w.rank, "up": w.up, "running": w.running, "waiting": w.waiting}
            for w in workers
        ],
        "version": __version__,
        "frontend": "sluice",
    }


def loads(state: ServerState) -> dict[str, Any]:
    stats = state.pipeline.engine.stats()
    workers = _ranks(stats)
    per_worker = state.admission.max_running // len(workers)
    now = datetime.now(UTC).isoformat()
    return {
        "timestamp": now,
        "version": __version__,
        "dp_rank_count": len(workers),
        "queued_at_front_door": state.admission.queued,
        "loads": [
            {
                "timestamp": now,
                "dp_rank": w.rank,
                "num_running_reqs": w.running,
                "num_waiting_reqs": w.waiting,
                "num_total_reqs": w.running + w.waiting,
                "max_running_requests": per_worker,
                "cache_hit_rate": round(w.cache_hit_rate, 4),  # this worker's own cache
            }
            for w in workers
            if w.up
        ],
    }


async def get_server_info(request: web.Request) -> web.Response:
    return json_response(server_info(_state(request)))


async def get_model_info(request: web.Request) -> web.Response:
    return json_response(model_info(_state(request)))


async def get_loads(request: web.Request) -> web.Response:
    for name in request.query.getall("include", []):
        for section in filter(None, name.split(",")):
            if section not in LOAD_SECTIONS:
                raise ApiError.bad_request(
                    f"Unknown include section {section!r}: Sluice reports "
                    f"{', '.join(sorted(LOAD_SECTIONS))}",
                    "include",
                )
    if request.query.get("format", "json") != "json":
        raise ApiError.bad_request("format must be json (Prometheus: GET /metrics)", "format")
    return json_response(loads(_state(request)))


# ------------------------------------------------------------------------ actions


async def health_generate(request: web.Request) -> web.Response:
    """One token generated end to end through the pipeline and engine, as SGLang's
    check does (bypassing admission: it asks whether the engine works, not for room)."""
    state = _state(request)
    job = GenerationJob(
        request_id=f"health-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=state.model_name,
        prompts=(Prompt(ids=(0,)),),
        sampling=SamplingParams(max_tokens=1, temperature=0.0),
    )
    run = RequestRun(state.pipeline, job)
    await run.prepare()

    async def ignore(_batch: list[LifecycleEvent]) -> None:
        return None

    with anyio.move_on_after(HEALTH_TIMEOUT_S):
        if isinstance(await run.pump(ignore), Completed | Incomplete):
            return web.Response(status=200)
    raise ApiError(503, "The engine did not generate a token.", code="unhealthy")


async def flush_cache(request: web.Request) -> web.Response:
    if await _state(request).pipeline.engine.flush_cache():
        return web.Response(text="Cache flushed.\n")
    return web.Response(
        status=400,
        text="Cache not flushed: requests are running or waiting. Retry when idle.\n",
    )


def abort_request(read_json: ReadJson) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        fields = Fields.of_body(await read_json(request))
        rid = fields.string("rid") or ""
        abort_all = fields.boolean("abort_all", False)
        fields.finish()
        state = _state(request)
        targets = list(state.active.ids) if abort_all else [rid]
        for request_id in targets:
            if request_id in state.active.ids:
                state.pipeline.engine.cancel(request_id)
        return web.Response(status=200)

    return handle


def _model_field(fields: Fields, state: ServerState) -> None:
    model = fields.string("model")
    if model is not None:
        check_model(state, model)


def tokenize(read_json: ReadJson) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A body no larger than one full-context prompt needs, as JSON (``prompt_bounds``),
    and each text refused before tokenizing if it is too long for the context: SGLang
    would count such a text, at a cost of seconds and gigabytes for megabytes of it."""

    async def handle(request: web.Request) -> web.Response:
        state = _state(request)
        context = state.pipeline.context_length
        # A scan of the vocabulary the first time, cached after: off the event loop.
        reach = await anyio.to_thread.run_sync(token_reach, state.pipeline.tokenizer)
        max_bytes = None
        if reach is not None:
            max_bytes = reach.max_json_bytes(context) + OTHER_FIELDS_BYTES
        note = (
            f" for {request.path}: a prompt as long as the model's context ({context} "
            "tokens) can hold, as JSON"
        )
        fields = Fields.of_body(await read_json(request, max_bytes=max_bytes, limit_note=note))
        _model_field(fields, state)
        prompt = fields.take("prompt")
        add_special = fields.boolean("add_special_tokens", True)
        fields.finish()
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise type_error("prompt", "a string or an array of strings", prompt)
        if reach is not None:
            _refuse_unfit(texts, isinstance(prompt, str), reach, context)
        encode = state.pipeline.tokenizer.encode

        def encode_all() -> list[list[int]]:
            return [encode(text, add_special_tokens=add_special) for text in texts]

        # Long texts take milliseconds and more: off the event loop, as prompts are.
        long = sum(map(len, texts)) > INLINE_CHARS
        tokens = await anyio.to_thread.run_sync(encode_all) if long else encode_all()
        single = isinstance(prompt, str)
        return json_response({
            "tokens": tokens[0] if single else tokens,
            "count": len(tokens[0]) if single else [len(t) for t in tokens],
            "max_model_len": state.pipeline.context_length,
        })  # fmt: skip

    return handle


def _refuse_unfit(texts: list[str], single: bool, reach: TokenReach, context: int) -> None:
    for i, text in enumerate(texts):
        refuse_unfit(text, reach, context, "prompt" if single else f"prompt[{i}]")


def detokenize(read_json: ReadJson) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        state = _state(request)
        context = state.pipeline.context_length
        note = f" for {request.path}: the token ids of the model's full context ({context} tokens)"
        max_bytes = context * ID_JSON_BYTES + OTHER_FIELDS_BYTES
        fields = Fields.of_body(await read_json(request, max_bytes=max_bytes, limit_note=note))
        _model_field(fields, state)
        tokens = fields.take("tokens")
        skip = fields.boolean("skip_special_tokens", True)
        fields.finish()
        single = isinstance(tokens, list) and all(_is_id(t) for t in tokens)
        batch = [tokens] if single else tokens
        if not isinstance(batch, list) or not all(
            isinstance(ids, list) and all(_is_id(t) for t in ids) for ids in batch
        ):
            raise type_error("tokens", "an array of token ids or of arrays of them", tokens)
        tokenizer = state.pipeline.tokenizer
        vocab = len(tokenizer)
        if any(t >= vocab for ids in batch for t in ids):
            raise ApiError.bad_request(f"Token ids must be below the vocabulary size {vocab}",
                                       "tokens")  # fmt: skip

        def decode_all() -> list[str]:
            return [tokenizer.decode(ids, skip_special_tokens=skip) for ids in batch]

        long = sum(map(len, batch)) > INLINE_CHARS
        texts = await anyio.to_thread.run_sync(decode_all) if long else decode_all()
        return json_response({"text": texts[0] if single else texts})

    return handle


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def register(app: web.Application, read_json: ReadJson) -> None:
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, get_server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, get_model_info)
    app.router.add_get("/v1/loads", get_loads)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_route("POST", "/flush_cache", flush_cache)
    app.router.add_route("GET", "/flush_cache", flush_cache)
    app.router.add_post("/abort_request", abort_request(read_json))
    for prefix in ("", "/v1"):
        app.router.add_post(f"{prefix}/tokenize", tokenize(read_json))
        app.router.add_post(f"{prefix}/detokenize", detokenize(read_json))

"""``sluice``: load the model and serve the OpenAI API.

Flags follow SGLang's names where SGLang has them (``--model-path``,
``--served-model-name``, ``--context-length``, ``--max-running-requests``, …).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import os
import signal
import socket
import ssl
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog

from sluice.engine.cpu import host_cpu
from sluice.engine.data_parallel import DataParallelEngine
from sluice.engine.loader import (
    ModelLoadError,
    gemm_shapes,
    load_causal_lm,
    load_tokenizer,
    resolve_model,
)
from sluice.engine.model_facts import ModelFacts
from sluice.engine.precision import PrecisionChoice, choose_precision, default_cache_dir
from sluice.engine.quantization import (
    NONE,
    QUANTIZATION_METHODS,
    QuantizationChoice,
    apply_quantization,
    choose_quantization,
)
from sluice.engine.routing import Balance
from sluice.engine.scheduler import SchedulerConfig
from sluice.engine.speculative import ALGORITHMS as SPECULATIVE_ALGORITHMS
from sluice.engine.speculative import SpeculativeConfig
from sluice.engine.torch_engine import TorchEngine
from sluice.events.recorder import FileRecorder
from sluice.logging import configure_logging
from sluice.pipeline.chat import ChatSetup
from sluice.pipeline.chat_template import TemplateConfigError
from sluice.pipeline.reasoning import REASONING_FORMATS
from sluice.pipeline.runner import PipelineContext
from sluice.pipeline.token_text import TokenTexts
from sluice.pipeline.tool_formats import TOOL_PARSERS

T = TypeVar("T")

log = structlog.get_logger("sluice")

_CLEANUP_GRACE_S = 2.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sluice", description=__doc__)
    p.add_argument(
        "--model-path",
        help="a .gguf file or a transformers folder "
        "(default: the SmolLM2-135M-Instruct GGUF under ./models)",
    )
    p.add_argument("--served-model-name", help="the model id clients use (default: from the path)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics",
    )
    p.add_argument(
        "--api-key-file",
        help="more accepted keys, one a line (blank lines and # comments skipped)",
    )
    p.add_argument(
        "--allowed-origins",
        action="append",
        default=[],
        metavar="ORIGINS",
        help="CORS: browser origins allowed to call, comma-separated or repeated; * for any",
    )
    p.add_argument("--ssl-certfile", help="serve HTTPS with this PEM certificate (chain)")
    p.add_argument("--ssl-keyfile", help="the PEM private key of --ssl-certfile")
    p.add_argument("--context-length", type=int, help="default: the model's own")
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=64,
        help="sequences decoded together in one engine step; also the front door's slots",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="requests waiting for a slot; beyond them a request gets 429",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=60.0,
        help="seconds a request may wait for a slot before it gets 503",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds in-flight requests get to finish",
    )
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=512,
        help="prompt tokens prefilled per engine step",
    )
    p.add_argument(
        "--disable-mixed-chunk",
        action="store_true",
        help="prefill and decode in separate forwards instead of one packed forward per step",
    )
    p.add_argument(
        "--speculative-algorithm",
        choices=SPECULATIVE_ALGORITHMS,
        help="NGRAM: each decode step also verifies a draft copied from the sequence's own "
        "earlier tokens (no draft model); outputs are the same as without it",
    )
    p.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        metavar="N",
        help=f"with --speculative-algorithm: the longest draft a step verifies "
        f"(default {SpeculativeConfig.num_draft_tokens})",
    )
    p.add_argument(
        "--speculative-ngram-min-match-window-size",
        type=int,
        metavar="N",
        help=f"NGRAM: the fewest last tokens that must match earlier ones to draft "
        f"(default {SpeculativeConfig.min_window})",
    )
    p.add_argument(
        "--speculative-ngram-max-match-window-size",
        type=int,
        metavar="N",
        help=f"NGRAM: the most last tokens compared when choosing among earlier matches "
        f"(default {SpeculativeConfig.max_window})",
    )
    p.add_argument("--kv-cache-gb", type=float, default=4.0, help="KV cache memory budget")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="auto: bfloat16 on CUDA; on CPUs with bf16 arithmetic (AVX512-BF16, AMX) "
        "bfloat16 where the model's GEMMs, timed at start-up, run ≥1.1× faster in it; "
        "else float32",
    )
    p.add_argument(
        "--quantization",
        choices=QUANTIZATION_METHODS,
        help="gguf (the default for a GGUF of Q4_0/Q4_1/Q4_K weights on the CPU): those "
        "weights served as the file stores them, by a packed 4-bit GEMM; w8a8_int8: int8 "
        "weights (per channel) and activations (per token) in the decoder's linears; "
        "none: the de-quantised weights in --dtype. The LM head stays in --dtype",
    )
    p.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="on CUDA, run decode steps eagerly instead of replaying captured graphs",
    )
    p.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=0,
        metavar="N",
        help="the largest decode batch replayed from a CUDA graph "
        "(default: --max-running-requests); larger batches step eagerly",
    )
    p.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads of each engine (default: the cores, shared out "
        "between --dp-size workers)",
    )
    p.add_argument(
        "--dp-size",
        type=int,
        default=1,
        metavar="N",
        help="engine worker processes behind this one front end, each with its own model "
        "replica and KV cache (one GPU each with --device cuda)",
    )
    p.add_argument(
        "--load-balance-method",
        choices=["cache_aware", "least_load"],
        default="cache_aware",
        help="with --dp-size: send a request to the worker its prompt_cache_key (or user) "
        "went to, or that holds its longest cached prefix, unless that worker is "
        "overloaded; or always to the least loaded",
    )
    balance = Balance()
    p.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=balance.abs_threshold,
        metavar="N",
        help="cache_aware: a worker is overloaded once it has more than N sequences in "
        "flight beyond the least busy one …",
    )
    p.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=balance.rel_threshold,
        metavar="X",
        help="… and more than X times its count (SMG's names; both must hold)",
    )
    p.add_argument(
        "--cache-threshold",
        type=float,
        default=balance.cache_threshold,
        metavar="F",
        help="cache_aware: a cached prefix draws a request only when it covers at least "
        "this fraction of the prompt",
    )
    # An engine worker of a --dp-size front end: the socket it connects to, its rank.
    p.add_argument("--engine-worker", metavar="SOCKET", help=argparse.SUPPRESS)
    p.add_argument("--dp-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument(
        "--chat-template",
        help="a built-in name (chatml, llama-3, mistral, qwen2.5, gemma, deepseek-v3), "
        "a Jinja file or a JSON file (default: the model's own template)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        help="the model's tool-call format (default: recognised from the chat template, "
        "else 'json', a generic format the prompt describes)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_FORMATS),
        help="split the model's reasoning block into reasoning_content",
    )
    p.add_argument("--record-dir", type=Path, help="write each request's events here as JSONL")
    p.add_argument("--log-format", choices=["console", "json"], default="console")
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--responses-db",
        default="data/responses.sqlite3",
        metavar="PATH|URL",
        help="where stored /v1/responses are kept: an SQLite file (created if missing; "
        "':memory:' keeps them only while the server runs), or a postgresql:// URL that "
        "several servers share",
    )
    p.add_argument(
        "--responses-owner",
        metavar="NAME",
        help="this server's name among those sharing a PostgreSQL --responses-db: at "
        "start-up it fails only the unfinished responses it owns (default: host:port; "
        "keep it stable across restarts)",
    )
    p.add_argument(
        "--trace-prompts",
        action="store_true",
        help="include prompt and output text in the /v1/responses lifecycle traces",
    )
    return p


@dataclass
class Loaded:
    pipeline: PipelineContext
    engine: TorchEngine | DataParallelEngine
    model_name: str
    facts: ModelFacts
    chat: ChatSetup | None
    precision: PrecisionChoice
    quantization: QuantizationChoice


@dataclass
class Prepared:
    """What the front end needs before (and without) a model: flags checked, the model
    resolved (converted once), the dtype and quantisation settled, tokenizer and chat
    setup."""

    folder: Path
    source: Path  # the GGUF file the folder was converted from, or the folder
    name: str
    tokenizer: Any
    chat: ChatSetup | None
    precision: PrecisionChoice
    quantization: QuantizationChoice


def prepare(args: argparse.Namespace) -> Prepared:
    """Raises ``ModelLoadError`` for a bad flag or model, before any weights load."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was given but no CUDA device is available")
    if args.cuda_graph_max_bs < 0:
        raise ModelLoadError("--cuda-graph-max-bs must be 0 (the default) or more")
    if args.dp_size < 1:
        raise ModelLoadError("--dp-size must be at least 1")
    if args.dp_size > 1 and args.device == "cuda" and args.dp_size > torch.cuda.device_count():
        raise ModelLoadError(
            f"--dp-size {args.dp_size} needs one GPU each; {torch.cuda.device_count()} visible"
        )
    if args.balance_abs_threshold < 0 or args.balance_rel_threshold < 1:
        raise ModelLoadError(
            "--balance-abs-threshold must be at least 0 and --balance-rel-threshold at least 1"
        )
    if not 0 <= args.cache_threshold <= 1:
        raise ModelLoadError("--cache-threshold must be between 0 and 1")
    speculative_config(args)
    torch.set_num_threads(args.threads)  # before ``auto`` times GEMMs with them
    resolved = resolve_model(args.model_path)
    quantization = choose_quantization(
        args.quantization, resolved.source, resolved.matrix_types, args.device
    )
    log.info("quantization", **quantization.to_dict())
    precision = choose_precision(
        args.dtype,
        args.device,
        lambda: gemm_shapes(resolved.folder, quantized=quantization.method != NONE),
        cache_dir=default_cache_dir(),
    )
    log.info("precision", dtype=precision.dtype, reason=precision.reason,
             bf16_speedup=precision.speedup, cpu=precision.cpu or None)  # fmt: skip
    tokenizer = load_tokenizer(resolved.folder)
    try:  # before the model loads: a bad flag should fail fast
        chat = ChatSetup.for_tokenizer(
            args.chat_template,
            tokenizer,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
        )
    except TemplateConfigError as exc:
        raise ModelLoadError(str(exc)) from exc
    name = args.served_model_name or resolved.name
    return Prepared(
        resolved.folder, resolved.source, name, tokenizer, chat, precision, quantization
    )


_SPECULATIVE_SIZES = {
    "num_draft_tokens": "speculative_num_draft_tokens",
    "min_window": "speculative_ngram_min_match_window_size",
    "max_window": "speculative_ngram_max_match_window_size",
}


def _option(dest: str) -> str:
    """The command-line spelling of an argparse destination."""
    return "--" + dest.replace("_", "-")


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The speculative decoding the flags ask for; ``ModelLoadError`` for sizes given
    without ``--speculative-algorithm`` (they would do nothing) or out of range."""
    given = {field: getattr(args, flag) for field, flag in _SPECULATIVE_SIZES.items()}
    given = {field: value for field, value in given.items() if value is not None}
    if args.speculative_algorithm is None:
        if given:
            named = ", ".join(_option(_SPECULATIVE_SIZES[field]) for field in given)
            raise ModelLoadError(f"{named} needs --speculative-algorithm NGRAM")
        return None
    try:
        return SpeculativeConfig(**given)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc


def build_engine(
    args: argparse.Namespace, prepared: Prepared
) -> tuple[TorchEngine, ModelFacts, int]:
    """Load the weights and build the engine over them: (engine, facts, context)."""
    model = load_causal_lm(prepared.folder, dtype=prepared.precision.dtype, device=args.device)
    # The choice gains what was packed, known once the weights are.
    prepared.quantization = apply_quantization(
        model, prepared.quantization, prepared.folder, prepared.source
    )
    log.info("quantized", **prepared.quantization.to_dict())
    facts = ModelFacts.read(model, prepared.tokenizer)
    model_context = facts.context_length
    context = args.context_length or model_context
    if context is None:
        raise ModelLoadError(
            f"{facts.architecture} states no context length: pass --context-length"
        )
    if model_context is not None and context > model_context:
        raise ModelLoadError(
            f"--context-length {context} exceeds the model's own context length {model_context}"
        )
    engine = TorchEngine(
        model,
        config=SchedulerConfig(
            max_running=args.max_running_requests,
            context_length=context,
            prefill_chunk=args.chunked_prefill_size,
            mixed_chunk=not args.disable_mixed_chunk,
            speculative=speculative_config(args),
            kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)),
            fixed_shape_decode=args.device == "cuda" and not args.disable_cuda_graph,
            graph_max_batch=args.cuda_graph_max_bs,
        ),
        eos_token_ids=facts.eos_token_ids,
        device=args.device,
        threads=args.threads,
        tokenizer=prepared.tokenizer,
    )
    return engine, facts, context


def load(args: argparse.Namespace) -> Loaded:
    """Resolve, convert if needed, and load the model; raises ``ModelLoadError``."""
    prepared = prepare(args)
    engine, facts, context = build_engine(args, prepared)
    pipeline = PipelineContext(engine, prepared.tokenizer, TokenTexts(prepared.tokenizer), context)
    return Loaded(
        pipeline, engine, prepared.name, facts, prepared.chat, prepared.precision,
        prepared.quantization,
    )  # fmt: skip


def worker_argv(args: argparse.Namespace, prepared: Prepared, rank: int, socket: str) -> list[str]:
    """The command line of engine worker ``rank``: this server's engine flags, with the
    model already resolved (its GGUF, which ``gguf`` quantisation reads) and the dtype
    and quantisation already settled."""
    argv = [
        sys.executable, "-P", "-m", "sluice",
        "--engine-worker", socket, "--dp-rank", str(rank),
        "--model-path", str(prepared.source), "--dtype", prepared.precision.dtype,
        "--quantization", prepared.quantization.method,
        "--device", args.device, "--threads", str(args.threads),
        "--max-running-requests", str(args.max_running_requests),
        "--chunked-prefill-size", str(args.chunked_prefill_size),
        "--kv-cache-gb", str(args.kv_cache_gb),
        "--cuda-graph-max-bs", str(args.cuda_graph_max_bs),
        "--log-format", args.log_format, "--log-level", args.log_level,
    ]  # fmt: skip
    if args.context_length:
        argv += ["--context-length", str(args.context_length)]
    if args.disable_mixed_chunk:
        argv.append("--disable-mixed-chunk")
    if args.speculative_algorithm:
        argv += ["--speculative-algorithm", args.speculative_algorithm]
    for flag in _SPECULATIVE_SIZES.values():
        if getattr(args, flag) is not None:
            argv += [_option(flag), str(getattr(args, flag))]
    if args.disable_cuda_graph:
        argv.append("--disable-cuda-graph")
    return argv


async def load_data_parallel(args: argparse.Namespace, prepared: Prepared) -> Loaded:
    """Start ``--dp-size`` engine workers; the facts come from the first one's hello."""
    from sluice.engine.data_parallel import WorkerStartError
    from sluice.engine.wire import facts_from_dict

    def command(rank: int, socket: str) -> list[str]:
        return worker_argv(args, prepared, rank, socket)

    def environment(rank: int) -> dict[str, str] | None:
        if args.device != "cuda":
            return None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(args.dp_size)]
        return {**os.environ, "CUDA_VISIBLE_DEVICES": devices[rank]}

    engine = DataParallelEngine(
        command,
        args.dp_size,
        affinity=args.load_balance_method == "cache_aware",
        balance=Balance(
            args.balance_abs_threshold, args.balance_rel_threshold, args.cache_threshold
        ),
        environment=environment,
    )
    try:
        hello = await engine.start()
    except WorkerStartError as exc:
        raise ModelLoadError(str(exc)) from exc
    facts = facts_from_dict(hello["facts"])
    tokenizer = prepared.tokenizer
    pipeline = PipelineContext(engine, tokenizer, TokenTexts(tokenizer), engine.max_context)
    return Loaded(
        pipeline, engine, prepared.name, facts, prepared.chat, prepared.precision,
        prepared.quantization,
    )  # fmt: skip


def run_engine_worker(args: argparse.Namespace) -> int:
    """``--engine-worker SOCKET``: load the model, serve the engine to the front end."""
    from sluice.engine.wire import facts_to_dict
    from sluice.engine.worker import serve_worker

    # Ctrl-C reaches the whole process group: the front end drains, then stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    prepared = prepare(args)
    engine, facts, context = build_engine(args, prepared)
    hello = {"rank": args.dp_rank, "pid": os.getpid(), "facts": facts_to_dict(facts),
             "context_length": context, "dtype": prepared.precision.dtype}  # fmt: skip

    async def serve_engine() -> None:
        engine.start()
        await serve_worker(engine, args.engine_worker, hello, stop=engine.stop)

    asyncio.run(serve_engine())
    return 0


@dataclass
class Edge:
    """The security flags, checked before the model loads so that a mistake fails fast."""

    api_keys: frozenset[str]
    allowed_origins: tuple[str, ...]
    ssl_context: ssl.SSLContext | None


def edge_config(args: argparse.Namespace) -> Edge:
    from sluice.http.middleware import ConfigError, parse_origins, read_api_keys, tls_context

    try:
        return Edge(
            read_api_keys(args.api_key, args.api_key_file),
            parse_origins(args.allowed_origins),
            tls_context(args.ssl_certfile, args.ssl_keyfile),
        )
    except ConfigError as exc:
        raise ModelLoadError(str(exc)) from exc


def on_daemon_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """``fn(*args)`` on a daemon thread, so that a signal during a long load exits at
    once instead of waiting for it (an executor's thread would be joined at exit)."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def work() -> None:
        done.set_running_or_notify_cancel()  # so that giving up on it is no error later
        try:
            done.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001 - re-raised on the event loop
            done.set_exception(exc)

    threading.Thread(target=work, name="sluice-load", daemon=True).start()
    return asyncio.wrap_future(done)


async def load_any(args: argparse.Namespace) -> Loaded:
    """The model in this process, or (``--dp-size`` > 1) in engine worker processes."""
    if args.dp_size == 1:
        return await on_daemon_thread(load, args)
    prepared = await on_daemon_thread(prepare, args)
    return await load_data_parallel(args, prepared)


async def load_unless_stopped(args: argparse.Namespace, stop: asyncio.Event) -> Loaded | None:
    """``load_any``, given up (None) when a signal arrives first."""
    loading = asyncio.ensure_future(load_any(args))
    stopping = asyncio.ensure_future(stop.wait())
    either: list[asyncio.Future[Any]] = [loading, stopping]
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if loading.done():
        return loading.result()
    loading.cancel()  # workers being started are stopped (``DataParallelEngine.start``)
    with contextlib.suppress(asyncio.CancelledError, ModelLoadError):
        await loading
    return None


def server_settings(args: argparse.Namespace, loaded: Loaded) -> dict[str, object]:
    """The flags as this server resolved them, for ``/server_info`` (SGLang's resolved
    server args): no paths, no keys."""
    from sluice.http.store.opening import is_postgres

    return {
        "host": args.host,
        "port": args.port,
        "device": args.device,
        "cpu": host_cpu().to_dict(),  # what decided the kernels (and --dtype auto)
        "dtype": loaded.precision.dtype,
        "dtype_choice": loaded.precision.to_dict(),  # why: the flag, the CPU, or timings
        "quantization": loaded.quantization.method,
        "quantization_choice": loaded.quantization.to_dict(),  # why, and what was packed
        "max_running_requests": args.max_running_requests,
        "max_queued_requests": args.max_queued_requests,
        "chunked_prefill_size": args.chunked_prefill_size,
        "enable_mixed_chunk": not args.disable_mixed_chunk,
        **speculative_settings(args),
        "threads": args.threads,
        "dp_size": args.dp_size,
        "load_balance_method": args.load_balance_method,
        "balance_abs_threshold": args.balance_abs_threshold,
        "balance_rel_threshold": args.balance_rel_threshold,
        "cache_threshold": args.cache_threshold,
        "api_key_required": bool(args.api_key or args.api_key_file),
        "responses_store": "postgresql" if is_postgres(args.responses_db) else "sqlite",
    }


def speculative_settings(args: argparse.Namespace) -> dict[str, object]:
    """``/server_info``'s speculative fields, with the sizes in effect (SGLang's names)."""
    config = speculative_config(args)
    if config is None:
        return {"speculative_algorithm": None}
    return {
        "speculative_algorithm": args.speculative_algorithm,
        **{flag: getattr(config, field) for field, flag in _SPECULATIVE_SIZES.items()},
    }


async def serve(args: argparse.Namespace, edge: Edge) -> None:
    """Listen at once (503 until the model is loaded), load the model, serve until
    SIGTERM or SIGINT, then drain: see docs/operations.md."""
    from aiohttp import web

    from sluice.http.admission import Admission
    from sluice.http.app import create_app
    from sluice.http.routes.responses import ResponsesService
    from sluice.http.state import Lifecycle, ServerState
    from sluice.http.store.opening import StoreOpenError, open_store, redacted

    lifecycle = Lifecycle()
    owner = args.responses_owner or f"{socket.gethostname()}:{args.port}"
    try:
        store = await open_store(args.responses_db, owner=owner)
    except StoreOpenError as exc:
        where = redacted(args.responses_db)
        raise ModelLoadError(f"cannot open --responses-db {where}: {exc}") from exc
    responses = ResponsesService(store, trace_prompts=args.trace_prompts)
    app = create_app(
        lifecycle,
        api_keys=edge.api_keys,
        allowed_origins=edge.allowed_origins,
        responses=responses,
    )
    # Generation requests are drained before cleanup; its own wait is for stragglers.
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=_CLEANUP_GRACE_S
    )
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, ssl_context=edge.ssl_context)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ModelLoadError(f"cannot listen on {args.host}:{args.port}: {exc}") from exc
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    scheme = "https" if edge.ssl_context else "http"
    url = f"{scheme}://{args.host}:{args.port}"
    log.info("listening, loading the model", url=url)
    engine: TorchEngine | DataParallelEngine | None = None
    try:
        loaded = await load_unless_stopped(args, stop)
        if loaded is not None:
            engine = loaded.engine
            if isinstance(engine, TorchEngine):
                engine.start()
            admission = Admission(  # every worker's slots behind one front door
                args.max_running_requests * args.dp_size,
                args.max_queued_requests,
                args.queue_timeout,
            )
            recorder = FileRecorder(args.record_dir) if args.record_dir else None
            state = ServerState(
                loaded.pipeline,
                loaded.model_name,
                recorder,
                chat=loaded.chat,
                facts=loaded.facts,
                admission=admission,
                settings=server_settings(args, loaded),
            )
            lifecycle.ready(state)
            log.info(
                "serving",
                url=url,
                model=loaded.model_name,
                device=args.device,
                dtype=loaded.precision.dtype,
                cpu=host_cpu().line(),
            )
            await stop.wait()
        log.info("shutting down", shutdown_timeout=args.shutdown_timeout)
        await site.stop()  # new connections are refused from here on
        await lifecycle.drain(args.shutdown_timeout)
        # The responses store closes in the app's cleanup, after the drain.
    finally:
        await runner.cleanup()
        if isinstance(engine, TorchEngine):
            await asyncio.to_thread(engine.stop)
        elif engine is not None:
            await engine.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // max(args.dp_size, 1))
    configure_logging(args.log_format, args.log_level)
    if args.engine_worker:
        try:
            return run_engine_worker(args)
        except ModelLoadError as exc:
            print(f"sluice engine worker {args.dp_rank}: error: {exc}", file=sys.stderr)
            return 2
    try:
        edge = edge_config(args)
        asyncio.run(serve(args, edge))
    except ModelLoadError as exc:
        print(f"sluice: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``sluice``: load the model and serve the OpenAI API.

Flags follow SGLang's names where SGLang has them (``--model-path``,
``--served-model-name``, ``--context-length``, ``--max-running-requests``, …).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import ssl
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from sluice.dataparallel.routing import Balance
from sluice.engine.cpu import host_cpu
from sluice.engine.host_memory import keep_freed_memory
from sluice.engine.interface import EngineBackend
from sluice.engine.loader import ModelLoadError
from sluice.engine.platform import PLATFORMS
from sluice.engine.quantization import QUANTIZATION_METHODS
from sluice.engine.speculative import ALGORITHMS as SPECULATIVE_ALGORITHMS
from sluice.engine.speculative import SpeculativeConfig
from sluice.events.recorder import FileRecorder
from sluice.loading import Loaded, load_unless_stopped, run_engine_worker
from sluice.logging import configure_logging
from sluice.pipeline.reasoning import REASONING_FORMATS
from sluice.pipeline.tool_formats import TOOL_PARSERS

if TYPE_CHECKING:  # the HTTP side is imported when the server starts, not to parse flags
    from sluice.http.connections import ConnectionLimits

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
    p.add_argument(
        "--no-webui",
        dest="webui",
        action="store_false",
        help="do not serve the chat and response-lifecycle page at /",
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
        "--max-connections",
        type=int,
        metavar="N",
        help="open client connections at most; at the cap a new one closes the one that "
        "has waited longest for its request, and is itself refused (503) only while every "
        "connection has a request in progress (default: the open-file limit, raised to "
        "its hard limit at start-up, less 128 for the server's own files; at most 16384)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="seconds a connection has to send a request's headers: from connecting (and "
        "the TLS handshake), or on a kept-alive connection from the request's first byte",
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
    p.add_argument("--device", choices=sorted(PLATFORMS), default="cpu")
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
        help="gguf (the default for a GGUF of Q4_0/Q4_1/Q4_K/Q5_0/Q8_0 weights on the "
        "CPU): those weights, the LM head included, served as the file stores them, by "
        "a packed 4-bit GEMM; w8a8_int8: int8 weights (per channel) and activations (per "
        "token) in the decoder's linears, the LM head in --dtype; none: the de-quantised "
        "weights in --dtype",
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
        "--enable-torch-compile",
        action="store_true",
        help="on the CPU, compile the decode step with torch.compile (inductor), one "
        "compile per batch bucket at start-up (minutes the first time; kept under "
        "models/cache/inductor for later starts)",
    )
    p.add_argument(
        "--torch-compile-max-bs",
        type=int,
        default=4,
        metavar="N",
        help="the largest decode batch that runs compiled; larger batches step eagerly",
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


def server_settings(
    args: argparse.Namespace, loaded: Loaded, limits: ConnectionLimits
) -> dict[str, object]:
    """The flags as this server resolved them, for ``/server_info`` (SGLang's resolved
    server args): no paths, no keys."""
    from sluice.http.store.opening import is_postgres

    return {
        "host": args.host,
        "port": args.port,
        # The engine's, from its one config (what --dp-size workers were sent too).
        **loaded.config.settings(),
        "cpu": host_cpu().to_dict(),  # what decided the kernels (and --dtype auto)
        "dtype": loaded.precision.dtype,
        "dtype_choice": loaded.precision.to_dict(),  # why: the flag, the CPU, or timings
        "quantization": loaded.quantization.method,
        "quantization_choice": loaded.quantization.to_dict(),  # why, and what was packed
        "decode_path": loaded.decode_path,  # direct or transformers' layers, and why
        "max_queued_requests": args.max_queued_requests,
        "max_connections": limits.max_connections,  # as sized from the open-file limit
        "header_timeout": limits.header_timeout,
        "dp_size": args.dp_size,
        "load_balance_method": args.load_balance_method,
        "balance_abs_threshold": args.balance_abs_threshold,
        "balance_rel_threshold": args.balance_rel_threshold,
        "cache_threshold": args.cache_threshold,
        "api_key_required": bool(args.api_key or args.api_key_file),
        "webui": args.webui,
        "responses_store": "postgresql" if is_postgres(args.responses_db) else "sqlite",
    }


async def serve(args: argparse.Namespace, edge: Edge) -> None:
    """Listen at once (503 until the model is loaded), load the model, serve until
    SIGTERM or SIGINT, then drain: see docs/operations.md."""
    from aiohttp import web

    from sluice.http.admission import Admission
    from sluice.http.app import create_app
    from sluice.http.connections import (
        Connections,
        GuardedSite,
        connection_limits,
        log_accept_errors,
    )
    from sluice.http.routes.responses import ResponsesService
    from sluice.http.state import Lifecycle, ServerState
    from sluice.http.store.opening import StoreOpenError, open_store, redacted

    try:
        limits = connection_limits(args.max_connections, args.header_timeout)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    loop = asyncio.get_running_loop()
    log_accept_errors(loop)
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
        webui=args.webui,
    )
    # Generation requests are drained before cleanup; its own wait is for stragglers.
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=_CLEANUP_GRACE_S
    )
    await runner.setup()
    assert runner.server is not None
    connections = Connections(runner.server, limits)
    site = GuardedSite(runner, connections, args.host, args.port, ssl_context=edge.ssl_context)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ModelLoadError(f"cannot listen on {args.host}:{args.port}: {exc}") from exc
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    scheme = "https" if edge.ssl_context else "http"
    url = f"{scheme}://{args.host}:{args.port}"
    log.info("listening, loading the model", url=url)
    engine: EngineBackend | None = None
    try:
        loaded = await load_unless_stopped(args, stop)
        if loaded is not None:
            engine = loaded.engine  # started: it serves from here on
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
                settings=server_settings(args, loaded, limits),
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
        if engine is not None:
            await engine.close()


def main(argv: list[str] | None = None) -> int:
    # Before any thread starts, so that the engine's step thread allocates from the
    # main heap too (engine/host_memory.py); the load logs what it set.
    keep_freed_memory()
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

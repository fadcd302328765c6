"""From the flags to a loaded engine: the model resolved (converted once), its
quantisation and precision settled, the weights loaded and the engine built over them,
in this process or in ``--dp-size`` engine worker processes (each started with this
server's engine flags)."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog

from sluice.dataparallel.frontend import DataParallelEngine
from sluice.dataparallel.routing import Balance
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
    QuantizationChoice,
    apply_quantization,
    choose_quantization,
)
from sluice.engine.scheduler import SchedulerConfig
from sluice.engine.speculative import SpeculativeConfig
from sluice.engine.torch_engine import TorchEngine
from sluice.pipeline.chat import ChatSetup
from sluice.pipeline.chat_template import TemplateConfigError
from sluice.pipeline.runner import PipelineContext
from sluice.pipeline.token_text import TokenTexts

T = TypeVar("T")

log = structlog.get_logger("sluice")


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
    from sluice.dataparallel.frontend import WorkerStartError
    from sluice.dataparallel.wire import facts_from_dict

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
    from sluice.dataparallel.wire import facts_to_dict
    from sluice.dataparallel.worker import serve_worker

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


def speculative_settings(args: argparse.Namespace) -> dict[str, object]:
    """``/server_info``'s speculative fields, with the sizes in effect (SGLang's names)."""
    config = speculative_config(args)
    if config is None:
        return {"speculative_algorithm": None}
    return {
        "speculative_algorithm": args.speculative_algorithm,
        **{flag: getattr(config, field) for field, flag in _SPECULATIVE_SIZES.items()},
    }

"""From the flags to a loaded engine: the engine config built and checked once
(``engine.config``), the model resolved (converted once), its quantisation and
precision settled, the weights loaded and the engine built over them, in this process
or in ``--dp-size`` engine worker processes (each sent the settled config when it
connects)."""

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
from sluice.dataparallel.worker import connect, serve_worker
from sluice.engine.compiled_step import use_cache_dir
from sluice.engine.config import EngineConfig
from sluice.engine.grammar import TokenGrammar
from sluice.engine.host_memory import keep_freed_memory
from sluice.engine.interface import EngineBackend
from sluice.engine.loader import (
    ModelLoadError,
    default_models_dir,
    gemm_shapes,
    load_causal_lm,
    load_tokenizer,
    resolve_model,
)
from sluice.engine.model_facts import ModelFacts
from sluice.engine.platform import platform
from sluice.engine.precision import PrecisionChoice, choose_precision, default_cache_dir
from sluice.engine.quantization import (
    NONE,
    QuantizationChoice,
    apply_quantization,
    choose_quantization,
)
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
    engine: EngineBackend
    config: EngineConfig  # settled: the dtype and quantisation in effect
    model_name: str
    facts: ModelFacts
    chat: ChatSetup | None
    precision: PrecisionChoice
    quantization: QuantizationChoice
    # Which layers decode steps run through, and why (an engine's, or the first
    # --dp-size worker's).
    decode_path: dict[str, str] | None


@dataclass
class Prepared:
    """What the front end needs before (and without) a model: flags checked, the model
    resolved (converted once), the dtype and quantisation settled (``config``),
    tokenizer and chat setup."""

    config: EngineConfig
    folder: Path
    source: Path  # the GGUF file the folder was converted from, or the folder
    name: str
    tokenizer: Any
    chat: ChatSetup | None
    precision: PrecisionChoice
    quantization: QuantizationChoice


def prepare(args: argparse.Namespace) -> Prepared:
    """Raises ``ModelLoadError`` for a bad flag or model, before any weights load."""

    config = EngineConfig.from_args(args)
    if args.dp_size < 1:
        raise ModelLoadError("--dp-size must be at least 1")
    device = platform(config.device)
    if args.dp_size > 1 and device.visible_devices and args.dp_size > device.device_count():
        raise ModelLoadError(
            f"--dp-size {args.dp_size} needs one {device.name} device each; "
            f"{device.device_count()} visible"
        )
    if args.balance_abs_threshold < 0 or args.balance_rel_threshold < 1:
        raise ModelLoadError(
            "--balance-abs-threshold must be at least 0 and --balance-rel-threshold at least 1"
        )
    if not 0 <= args.cache_threshold <= 1:
        raise ModelLoadError("--cache-threshold must be between 0 and 1")
    prepared = prepare_engine(config)
    try:  # before the model loads: a bad flag should fail fast
        prepared.chat = ChatSetup.for_tokenizer(
            args.chat_template,
            prepared.tokenizer,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
        )
    except TemplateConfigError as exc:
        raise ModelLoadError(str(exc)) from exc
    prepared.name = args.served_model_name or prepared.name
    return prepared


def prepare_engine(config: EngineConfig) -> Prepared:
    """The model resolved, its quantisation and precision chosen (or, in a worker sent
    a settled config, taken as given), its tokenizer loaded."""
    import torch

    if not platform(config.device).available():
        raise ModelLoadError(f"--device {config.device} was given but none is available")
    torch.set_num_threads(config.threads)  # before ``auto`` times GEMMs with them
    log.info("host memory", allocator=keep_freed_memory())
    resolved = resolve_model(config.model_path)
    quantization = choose_quantization(
        config.quantization, resolved.source, resolved.matrix_types, config.device
    )
    log.info("quantization", **quantization.to_dict())
    precision = choose_precision(
        config.dtype,
        config.device,
        lambda: gemm_shapes(resolved.folder, quantized=quantization.method != NONE),
        cache_dir=default_cache_dir(),
    )
    log.info("precision", dtype=precision.dtype, reason=precision.reason,
             bf16_speedup=precision.speedup, cpu=precision.cpu or None)  # fmt: skip
    settled = config.settled(
        model_path=str(resolved.source), dtype=precision.dtype, quantization=quantization.method
    )
    tokenizer = load_tokenizer(resolved.folder)
    return Prepared(
        settled, resolved.folder, resolved.source, resolved.name, tokenizer, None, precision,
        quantization,
    )  # fmt: skip


def build_engine(prepared: Prepared) -> tuple[TorchEngine, ModelFacts, int]:
    """Load the weights and build the engine over them: (engine, facts, context)."""
    config = prepared.config
    if config.torch_compile:
        use_cache_dir(default_models_dir() / "cache" / "inductor")
    model = load_causal_lm(prepared.folder, dtype=prepared.precision.dtype, device=config.device)
    # The choice gains what was packed, known once the weights are.
    prepared.quantization = apply_quantization(
        model, prepared.quantization, prepared.folder, prepared.source,
        compiled=config.torch_compile,
    )  # fmt: skip
    log.info("quantized", **prepared.quantization.to_dict())
    facts = ModelFacts.read(model, prepared.tokenizer)
    model_context = facts.context_length
    context = config.context_length or model_context
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
        config=config.scheduler(context),
        eos_token_ids=facts.eos_token_ids,
        device=config.device,
        threads=config.threads,
        tokenizer=prepared.tokenizer,
    )
    return engine, facts, context


def load(args: argparse.Namespace) -> Loaded:
    """Resolve, convert if needed, and load the model; raises ``ModelLoadError``."""
    prepared = prepare(args)
    engine, facts, context = build_engine(prepared)
    tokenizer = prepared.tokenizer
    pipeline = PipelineContext(engine, tokenizer, TokenTexts(tokenizer), context, engine.grammar)
    return Loaded(
        pipeline, engine, prepared.config, prepared.name, facts, prepared.chat,
        prepared.precision, prepared.quantization, _decode_path(engine),
    )  # fmt: skip


def _decode_path(engine: TorchEngine) -> dict[str, str] | None:
    return None if engine.decode_path is None else engine.decode_path.to_dict()


def worker_argv(args: argparse.Namespace, rank: int, socket: str) -> list[str]:
    """The command line of engine worker ``rank``: where to connect and how to log. Its
    engine settings come over the socket (``EngineConfig``), never as flags."""
    return [
        sys.executable, "-P", "-m", "sluice",
        "--engine-worker", socket, "--dp-rank", str(rank),
        "--log-format", args.log_format, "--log-level", args.log_level,
    ]  # fmt: skip


async def load_data_parallel(args: argparse.Namespace, prepared: Prepared) -> Loaded:
    """Start ``--dp-size`` engine workers; the facts come from the first one's hello."""
    from sluice.dataparallel.frontend import WorkerStartError
    from sluice.dataparallel.wire import facts_from_dict

    def command(rank: int, socket: str) -> list[str]:
        return worker_argv(args, rank, socket)

    def environment(rank: int) -> dict[str, str] | None:
        return platform(args.device).worker_environment(rank, args.dp_size, os.environ)

    engine = DataParallelEngine(
        command,
        args.dp_size,
        config=prepared.config.to_dict(),
        affinity=args.load_balance_method == "cache_aware",
        balance=Balance(
            args.balance_abs_threshold, args.balance_rel_threshold, args.cache_threshold
        ),
        environment=environment,
    )
    try:
        await engine.start()
    except WorkerStartError as exc:
        raise ModelLoadError(str(exc)) from exc
    facts = facts_from_dict(engine.hello["facts"])
    tokenizer = prepared.tokenizer
    # The workers compile again; the front end's compile refuses what cannot run.
    grammar = TokenGrammar(tokenizer, eos_token_ids=facts.eos_token_ids)
    pipeline = PipelineContext(
        engine, tokenizer, TokenTexts(tokenizer), engine.max_context, grammar
    )
    return Loaded(
        pipeline, engine, prepared.config, prepared.name, facts, prepared.chat,
        prepared.precision, prepared.quantization, engine.hello.get("decode_path"),
    )  # fmt: skip


def run_engine_worker(args: argparse.Namespace) -> int:
    """``--engine-worker SOCKET``: connect to the front end, take the engine config it
    sends, load the model and serve the engine to it."""
    from sluice.dataparallel.wire import facts_to_dict

    # Ctrl-C reaches the whole process group: the front end drains, then stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    async def serve_engine() -> None:
        connection = await connect(args.engine_worker)
        # Loading blocks this loop; nothing else runs in a worker until it is done.
        prepared = prepare_engine(EngineConfig.from_dict(connection.engine_config))
        engine, facts, context = build_engine(prepared)
        hello = {"rank": args.dp_rank, "pid": os.getpid(), "facts": facts_to_dict(facts),
                 "context_length": context, "dtype": prepared.precision.dtype,
                 "decode_path": _decode_path(engine)}  # fmt: skip
        await engine.start()
        await serve_worker(engine, connection, hello, stop=engine.stop)

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
    """The model in this process, or (``--dp-size`` > 1) in engine worker processes; the
    engine is started (its events come to this loop) when this returns."""
    if args.dp_size == 1:
        loaded = await on_daemon_thread(load, args)
        await loaded.engine.start()
        return loaded
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

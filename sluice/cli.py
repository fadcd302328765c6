"""``sluice``: load the model and serve the OpenAI API.

Flags follow SGLang's names where SGLang has them (``--model-path``,
``--served-model-name``, ``--context-length``, ``--max-running-requests``, …).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from sluice.engine.loader import ModelLoadError, load_causal_lm, load_tokenizer, resolve_model
from sluice.engine.scheduler import SchedulerConfig
from sluice.engine.torch_engine import TorchEngine
from sluice.events.recorder import Recorder
from sluice.logging import configure_logging
from sluice.pipeline.chat import ChatSetup
from sluice.pipeline.chat_template import TemplateConfigError
from sluice.pipeline.runner import PipelineContext
from sluice.pipeline.token_text import TokenTexts

log = structlog.get_logger("sluice")


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
    p.add_argument("--context-length", type=int, help="default: the model's own")
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=64,
        help="sequences decoded together in one engine step",
    )
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=512,
        help="prompt tokens prefilled per engine step",
    )
    p.add_argument("--kv-cache-gb", type=float, default=4.0, help="KV cache memory budget")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="auto: float32 on the CPU, bfloat16 on CUDA",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch intra-op threads of the engine",
    )
    p.add_argument(
        "--chat-template",
        help="a built-in name (chatml, llama-3, mistral, qwen2.5, gemma, deepseek-v3), "
        "a Jinja file or a JSON file (default: the model's own template)",
    )
    p.add_argument("--record-dir", type=Path, help="write each request's events here as JSONL")
    p.add_argument("--log-format", choices=["console", "json"], default="console")
    p.add_argument("--log-level", default="info")
    return p


@dataclass
class Loaded:
    pipeline: PipelineContext
    engine: TorchEngine
    model_name: str
    model_root: str
    chat: ChatSetup | None


def load(args: argparse.Namespace) -> Loaded:
    """Resolve, convert if needed, and load the model; raises ``ModelLoadError``."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was given but no CUDA device is available")
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if args.device == "cuda" else "float32"
    torch.set_num_threads(args.threads)
    resolved = resolve_model(args.model_path)
    tokenizer = load_tokenizer(resolved.folder)
    try:  # before the model loads: a bad flag should fail fast
        chat = ChatSetup.for_tokenizer(args.chat_template, tokenizer)
    except TemplateConfigError as exc:
        raise ModelLoadError(str(exc)) from exc
    model = load_causal_lm(resolved.folder, dtype=dtype, device=args.device)
    model_context = int(getattr(model.config, "max_position_embeddings", 2048))
    context = args.context_length or model_context
    if context > model_context:
        raise ModelLoadError(
            f"--context-length {context} exceeds the model's own context length {model_context}"
        )
    engine = TorchEngine(
        model,
        config=SchedulerConfig(
            max_running=args.max_running_requests,
            context_length=context,
            prefill_chunk=args.chunked_prefill_size,
            kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)),
        ),
        eos_token_ids=eos_token_ids(model, tokenizer),
        device=args.device,
        threads=args.threads,
    )
    pipeline = PipelineContext(engine, tokenizer, TokenTexts(tokenizer), context)
    name = args.served_model_name or resolved.name
    return Loaded(pipeline, engine, name, str(resolved.source), chat)


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


async def serve(args: argparse.Namespace, loaded: Loaded) -> None:
    from aiohttp import web

    from sluice.http.app import create_app
    from sluice.http.state import ServerState

    recorder = Recorder(args.record_dir) if args.record_dir else None
    state = ServerState(
        loaded.pipeline, loaded.model_name, loaded.model_root, recorder, chat=loaded.chat
    )
    loaded.engine.start()
    runner = web.AppRunner(create_app(state), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        loaded.engine.stop()
        raise ModelLoadError(f"cannot listen on {args.host}:{args.port}: {exc}") from exc
    log.info("serving", url=f"http://{args.host}:{args.port}", model=loaded.model_name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await runner.cleanup()
    loaded.engine.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    try:
        loaded = load(args)
        asyncio.run(serve(args, loaded))
    except ModelLoadError as exc:
        print(f"sluice: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A model-free server for the connection tests, in a process of its own: the real app
over the fake engine, listening through ``sluice.http.connections`` as ``sluice`` does,
under the open-file limit the test sets. Prints ``port N`` once it listens; stops on
SIGTERM. Run with the repository root at the end of ``sys.path`` (its ``http/`` would
shadow the standard library's at the front)."""

from __future__ import annotations

import argparse
import asyncio
import resource
import signal

from aiohttp import web

from sluice.http.app import create_app
from sluice.http.connections import Connections, GuardedSite, connection_limits, log_accept_errors
from sluice.logging import configure_logging
from tests.support.fake_engine import FakeEngine, fake_state


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer-dir", required=True)
    p.add_argument("--open-files", type=int, help="the soft and hard open-file limit")
    p.add_argument("--max-connections", type=int)
    p.add_argument("--header-timeout", type=float, default=30.0)
    args = p.parse_args(argv)
    if args.open_files:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.open_files, args.open_files))
    configure_logging("json", "info")
    asyncio.run(_serve(args))
    return 0


async def _serve(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    limits = connection_limits(args.max_connections, args.header_timeout)
    loop = asyncio.get_running_loop()
    log_accept_errors(loop)
    app = create_app(fake_state(tokenizer, FakeEngine(tokens=tokenizer.encode(" la"))))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    assert runner.server is not None
    await GuardedSite(runner, Connections(runner.server, limits), "127.0.0.1", 0).start()
    print(f"port {runner.addresses[0][1]}", flush=True)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await runner.cleanup()

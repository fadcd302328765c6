"""An engine worker process with no model: the ``--dp-size`` front end's real
supervision, wire and routing over ``bench.frontend``'s synthetic engine (one token per
running sequence per step). The tests' workers, and the bench's for what the process
boundary adds per request.

    python -P -m sluice.bench.synthetic_worker SOCKET RANK STEP_S [TOKEN,TOKEN,…]
"""

from __future__ import annotations

import asyncio
import os
import sys

from sluice.bench.frontend import SyntheticEngine
from sluice.dataparallel.worker import connect, serve_worker

TOKENS = (5, 6, 7)
CONTEXT = 4096


def main() -> None:
    socket, rank, step_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    tokens = tuple(map(int, sys.argv[4].split(","))) if len(sys.argv) > 4 else TOKENS
    engine = SyntheticEngine(tokens=tokens, step_s=step_s, max_context=CONTEXT)
    hello = {"rank": rank, "pid": os.getpid(), "context_length": CONTEXT, "facts": None,
             "dtype": "float32"}  # fmt: skip

    async def serve() -> None:
        # The front end's engine config is for a model; this worker has none.
        await serve_worker(engine, await connect(socket), hello)

    asyncio.run(serve())


if __name__ == "__main__":
    main()

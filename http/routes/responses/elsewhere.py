"""Responses that another front end runs, seen through the store they share
(``--responses-db postgresql://…``): a ``GET ?stream=true`` follows the logged events
to the end, and a cancel is relayed to the runner and awaited in the store.

A front end holds live runs only for what it runs itself; for the rest the store's
event log is the truth, written as each batch of events leaves the runner.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import orjson

from sluice.http.projections.responses import TERMINAL_EVENTS
from sluice.http.store import UNFINISHED, ResponseStore, StoredResponse

POLL_S = 0.2
"""How often a follower reads the log of a response running elsewhere."""
CANCEL_WAIT_S = 10.0


def _sequence_and_end(event: bytes) -> tuple[int, bool]:
    data = orjson.loads(event)
    # A cancelled response logs no terminal event: its stored status ends the follow.
    return int(data["sequence_number"]), data.get("type") in TERMINAL_EVENTS


async def follow_logged(
    store: ResponseStore, response_id: str, after: int
) -> AsyncIterator[list[bytes]]:
    """The logged events after ``after``, then the new ones as they are logged (a list
    per read), until the terminal event; ends early if the response is deleted or
    finishes without one."""
    while True:
        logged = await store.events(response_id, after)
        for i, event in enumerate(logged):
            after, end = _sequence_and_end(event)
            if end:
                yield logged[: i + 1]
                return
        if logged:
            yield logged
            continue
        stored = await store.get(response_id)
        if stored is None or stored.status not in UNFINISHED:
            # Finished meanwhile: the runner logs its events before the final status.
            rest = await store.events(response_id, after)
            if rest:
                yield rest
            return
        await anyio.sleep(POLL_S)


async def cancel_elsewhere(store: ResponseStore, response_id: str) -> StoredResponse | None:
    """Relay the cancel, then wait for the runner to store the outcome; None when the
    response is gone. ``TimeoutError`` when the runner did not answer within
    ``CANCEL_WAIT_S`` (its front end is down or overloaded)."""
    await store.request_cancel(response_id)
    with anyio.fail_after(CANCEL_WAIT_S):
        while True:
            stored = await store.get(response_id)
            if stored is None or stored.status not in UNFINISHED:
                return stored
            await anyio.sleep(POLL_S)

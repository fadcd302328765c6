"""The front door: a FIFO queue in front of the engine, counted in sequences.

A request holds one slot per sequence it submits (choices × prompts, ``best_of``
included) from admission until its events end. At most ``max_running`` slots are
held; a request that does not fit waits in a FIFO queue of at most ``max_queued``
requests, for at most ``queue_timeout`` seconds. Strict FIFO: a waiting request is
never overtaken, so none starves. A request larger than ``max_running`` is admitted
when nothing else runs and then runs alone, so it neither deadlocks nor waits forever.

Beyond the queue → 429 ``rate_limit_exceeded`` at once; too long in the queue →
503 ``queue_timeout``. Both carry ``Retry-After``. At shutdown the door closes
(new requests → 503), and ``abort()`` ends whatever is still queued or running.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio

from sluice.http.errors import ApiError

RETRY_AFTER_S = 1
"""What 429 and 503 advise: the queue turns over in about a request's time."""


def shutting_down() -> ApiError:
    return ApiError(
        503,
        "the server is shutting down",
        code="shutting_down",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


@dataclass(eq=False)
class Ticket:
    """An admitted request's claim. Run its work inside ``scope``: ``abort()`` cancels it."""

    size: int
    queued_s: float = 0.0
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


@dataclass(eq=False)
class _Waiter:
    size: int
    done: anyio.Event = field(default_factory=anyio.Event)
    error: ApiError | None = None  # set with ``done``: rejected instead of admitted


class Admission:
    def __init__(
        self, max_running: int = 64, max_queued: int = 256, queue_timeout: float = 60.0
    ) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.queue_timeout = queue_timeout
        self.running = 0  # sequences holding slots
        self._queue: deque[_Waiter] = deque()
        self._admitted: set[Ticket] = set()
        self._closed = False
        self._idle: anyio.Event | None = None

    @property
    def queued(self) -> int:
        """Requests waiting for slots."""
        return len(self._queue)

    @asynccontextmanager
    async def slots(self, size: int) -> AsyncIterator[Ticket]:
        """Hold ``size`` slots for the block; raises ``ApiError`` (429, 503) instead."""
        ticket = Ticket(size, await self._acquire(size))
        self._admitted.add(ticket)
        try:
            yield ticket
        finally:
            self._admitted.discard(ticket)
            self._release(size)

    def close(self) -> None:
        """Refuse new requests; queued and running ones carry on."""
        self._closed = True

    def abort(self) -> None:
        """End everything: queued requests get 503, running ones are cancelled."""
        self._closed = True
        while self._queue:
            waiter = self._queue.popleft()
            waiter.error = shutting_down()
            waiter.done.set()
        for ticket in self._admitted:
            ticket.scope.cancel()
        self._settle()

    async def wait_idle(self) -> None:
        """Return once nothing runs or waits."""
        if self._busy:
            if self._idle is None or self._idle.is_set():
                self._idle = anyio.Event()
            await self._idle.wait()

    # ---------------------------------------------------------------- internals

    @property
    def _busy(self) -> bool:
        return self.running > 0 or bool(self._queue)

    def _fits(self, size: int) -> bool:
        # An oversized request runs alone rather than never.
        return self.running == 0 or self.running + size <= self.max_running

    async def _acquire(self, size: int) -> float:
        """Seconds spent queued, once admitted."""
        if self._closed:
            raise shutting_down()
        if not self._queue and self._fits(size):
            self.running += size
            return 0.0
        if len(self._queue) >= self.max_queued:
            raise ApiError(
                429,
                f"The server is busy: {self.running} sequences are running and "
                f"{len(self._queue)} requests are queued. Retry later.",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        waiter = _Waiter(size)
        self._queue.append(waiter)
        started = time.perf_counter()
        try:
            with anyio.fail_after(self.queue_timeout):
                await waiter.done.wait()
        except TimeoutError:
            if not waiter.done.is_set():
                self._leave(waiter)
                raise ApiError(
                    503,
                    f"The request waited {self.queue_timeout:g} s in the queue "
                    "without being admitted. Retry later.",
                    code="queue_timeout",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                ) from None
        except BaseException:
            # Cancelled (client gone): give back whatever was granted meanwhile.
            if not waiter.done.is_set():
                self._leave(waiter)
            elif waiter.error is None:
                self._release(size)
            raise
        if waiter.error is not None:
            raise waiter.error
        return time.perf_counter() - started

    def _leave(self, waiter: _Waiter) -> None:
        self._queue.remove(waiter)
        self._admit_waiting()  # it may have been the head that blocked the rest
        self._settle()

    def _release(self, size: int) -> None:
        self.running -= size
        self._admit_waiting()
        self._settle()

    def _admit_waiting(self) -> None:
        while self._queue and self._fits(self._queue[0].size):
            waiter = self._queue.popleft()
            self.running += waiter.size
            waiter.done.set()

    def _settle(self) -> None:
        if self._idle is not None and not self._busy:
            self._idle.set()

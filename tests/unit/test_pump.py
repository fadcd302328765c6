"""Which event ends a run (``terminal_of``), and the one pump every consumer reads a
run through (``RequestRun.pump``): it stops at the batch that ends the run."""

from __future__ import annotations

import typing
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from sluice.events.types import (
    REQUEST,
    Cancelled,
    ChoiceFinished,
    Completed,
    Created,
    Delta,
    ErrorInfo,
    Failed,
    Incomplete,
    InProgress,
    LifecycleEvent,
    ToolCall,
    Usage,
    terminal_of,
)
from sluice.pipeline.runner import RequestRun

pytestmark = pytest.mark.anyio

USAGE = Usage(3, 2)
ONE_OF_EACH: list[LifecycleEvent] = [
    Created("r", REQUEST, 0, 0, "m"),
    InProgress("r", 0, 1, 3, 0),
    Delta("r", 0, 2, "hi", 1),
    ToolCall("r", 0, 3, 0, "call_1", "f", "{}"),
    ChoiceFinished("r", 0, 4, "stop", None, USAGE),
    Completed("r", REQUEST, 5, USAGE),
    Incomplete("r", REQUEST, 5, USAGE, "length"),
    Failed("r", REQUEST, 5, ErrorInfo("boom")),
    Cancelled("r", REQUEST, 5, "client gone"),
]
TERMINAL = (Completed, Incomplete, Failed, Cancelled)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_every_lifecycle_event_type_is_covered() -> None:
    assert {type(e) for e in ONE_OF_EACH} == set(typing.get_args(LifecycleEvent))


@pytest.mark.parametrize("event", ONE_OF_EACH, ids=lambda e: type(e).__name__)
def test_terminal_of_names_exactly_the_run_ending_events(event: LifecycleEvent) -> None:
    expected = event if isinstance(event, TERMINAL) else None
    assert terminal_of([ONE_OF_EACH[2], event]) is expected


class ScriptedRun(RequestRun):
    """A run whose flow is a fixed list of batches; counts what was pulled."""

    def __init__(self, batches: list[list[LifecycleEvent]]) -> None:
        self.batches = batches
        self.pulled = 0

    @asynccontextmanager
    async def events(self) -> AsyncIterator[AsyncIterator[list[LifecycleEvent]]]:
        async def flow() -> AsyncIterator[list[LifecycleEvent]]:
            for batch in self.batches:
                self.pulled += 1
                yield batch

        yield flow()


async def test_pump_stops_at_the_terminal_batch_and_returns_its_event() -> None:
    done = Completed("r", REQUEST, 5, USAGE)
    run = ScriptedRun([ONE_OF_EACH[:2], [ONE_OF_EACH[2], done], [ONE_OF_EACH[3]]])
    taken: list[list[LifecycleEvent]] = []

    async def take(batch: list[LifecycleEvent]) -> None:
        taken.append(batch)

    assert await run.pump(take) is done
    assert taken == run.batches[:2] and run.pulled == 2  # the batch after is never read


async def test_pump_returns_none_when_the_flow_ends_unfinished() -> None:
    run = ScriptedRun([ONE_OF_EACH[:3]])

    async def take(batch: list[LifecycleEvent]) -> None:
        return None

    assert await run.pump(take) is None and run.pulled == 1

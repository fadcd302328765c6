"""Engine events collected per (request, choice), for tests that drive the step
scheduler in process, and a helper that steps it until it is idle."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sluice.engine.assembly import ModelScheduler
from sluice.events.types import EngineEvent, PromptProcessed, SequenceFinished, TokenSampled


class Events:
    """Collects engine events per (request, choice)."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[str, int], list[EngineEvent]] = defaultdict(list)

    def __call__(self, sink: Any, event: EngineEvent) -> None:
        self.by_key[(event.request_id, event.choice_index)].append(event)

    def tokens(self, rid: str, choice: int = 0) -> list[int]:
        return [e.token_id for e in self.by_key[(rid, choice)] if isinstance(e, TokenSampled)]

    def finish(self, rid: str, choice: int = 0) -> SequenceFinished:
        last = self.by_key[(rid, choice)][-1]
        assert isinstance(last, SequenceFinished)
        return last

    def prompt(self, rid: str, choice: int = 0) -> PromptProcessed:
        first = self.by_key[(rid, choice)][0]
        assert isinstance(first, PromptProcessed)
        return first


def drain(sch: ModelScheduler, events: Events) -> None:
    while sch.has_work:
        sch.step(events)

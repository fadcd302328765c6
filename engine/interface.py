"""The engine seen from the pipeline: submit sequences, receive events, cancel.

The local torch engine, the replay backend (recorded events instead of a model) and
a remote backend (SGLang workers) all fit behind this interface.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from sluice.events.types import EngineEvent

from .params import SequenceSpec

EventSink = Callable[[Sequence[EngineEvent]], None]
"""Receives a batch of engine events on the event-loop thread, in order."""


class EngineBackend(Protocol):
    """Generates sequences; every submitted sequence ends in one ``SequenceFinished``.

    The server calls ``start`` once, on its event loop, before the first ``submit``,
    and ``close`` once when it shuts down (what still runs ends with an error event).
    A backend with nothing to start or stop inherits these from the protocol."""

    max_context: int  # the longest prompt plus completion it takes, in tokens

    async def start(self) -> None:
        """Start serving (threads, worker processes); events go to the calling loop."""
        return None

    async def close(self) -> None:
        """Stop: every sequence still running ends, and nothing runs after."""
        return None

    def submit(self, specs: Sequence[SequenceSpec], sink: EventSink) -> None:
        """Queue sequences; their events go to ``sink`` on the event loop thread."""

    def cancel(self, request_id: str, choice_index: int | None = None) -> None:
        """Retire the request's sequences (one choice, or all) at the next step."""

    def stats(self) -> EngineStats: ...

    async def flush_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while sequences run, as SGLang's
        ``/flush_cache`` is."""


@dataclass(frozen=True)
class WorkerStats:
    """One engine worker of several (``--dp-size``), as the front end sees it."""

    rank: int
    up: bool
    running: int
    waiting: int
    restarts: int
    # Its own prefix cache's figures (since it last started), and the sequences the
    # front end has sent it.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    routed: int = 0

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state and counters (``/metrics`` reads it)."""

    running: int = 0
    waiting: int = 0
    steps: int = 0
    mixed_steps: int = 0  # of ``steps``: prefill and decode in one packed forward
    # Speculative decoding: draft tokens verified, and of them those kept.
    draft_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    kv_cache_bytes: int = 0
    # Per worker, when the engine is several processes (``--dp-size``); else empty.
    workers: tuple[WorkerStats, ...] = ()

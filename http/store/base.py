"""The store's interface: what the Responses routes need, nothing about how it is kept.

Every method is async: an implementation does its blocking work off the event loop.
Bodies travel as JSON bytes (the exact bytes stored are the bytes served) or as
decoded items where the routes compute with them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Item = dict[str, Any]
Order = Literal["asc", "desc"]
UNFINISHED = ("queued", "in_progress")
"""The statuses of a response that is still to run or running."""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response: its latest ``Response`` body and what continuing it needs."""

    id: str
    status: str
    background: bool
    body: bytes  # the Response object as JSON
    history: tuple[Item, ...]  # the items before this response's input (its previous chain)


@dataclass(frozen=True, slots=True)
class LoggedEvent:
    """One logged stream event and when it was logged (None: logged by a version that
    kept no clock, or written at start-up for a response its process left unfinished)."""

    body: bytes
    at: float | None


@dataclass(frozen=True, slots=True)
class StoredItem:
    response_id: str
    item: Item


class ResponseStore(ABC):
    """Responses by id, their input items in order, output items, and event logs."""

    @abstractmethod
    async def create(
        self,
        response_id: str,
        *,
        created_at: int,
        status: str,
        background: bool,
        body: bytes,
        history: Sequence[Item],
        input_items: Sequence[Item],
    ) -> None:
        """A new response with its input items (each with an ``id``)."""

    @abstractmethod
    async def update(
        self,
        response_id: str,
        *,
        status: str,
        body: bytes,
        output_items: Sequence[Item] | None = None,
    ) -> bool:
        """Replace the body and status; with ``output_items``, store them too (the end).

        False when the response is gone (deleted meanwhile)."""

    @abstractmethod
    async def append_events(
        self, response_id: str, events: Sequence[tuple[int, bytes]], at: float | None = None
    ) -> None:
        """Append ``(sequence_number, event JSON)`` pairs to the response's event log;
        ``at``: when they happened (Unix seconds), kept beside the events, never in them,
        so a replayed stream stays byte for byte what the client got."""

    @abstractmethod
    async def get(self, response_id: str) -> StoredResponse | None: ...

    @abstractmethod
    async def delete(self, response_id: str) -> bool:
        """Remove the response, its items and its events; False when unknown."""

    @abstractmethod
    async def events(self, response_id: str, after: int) -> list[bytes]:
        """The logged events whose sequence number is greater than ``after``, in order."""

    @abstractmethod
    async def timed_events(self, response_id: str) -> list[LoggedEvent]:
        """The whole event log in order, each event with the time it was logged."""

    @abstractmethod
    async def input_items(
        self, response_id: str, *, limit: int, order: Order, after: str | None
    ) -> tuple[list[Item], bool] | None:
        """A page of input items and whether more follow; None when ``after`` is unknown."""

    @abstractmethod
    async def conversation(self, response_id: str) -> list[Item] | None:
        """The whole conversation a continuation of ``response_id`` starts from: its
        history, its input items, then its output items. None when unknown."""

    @abstractmethod
    async def find_item(self, item_id: str) -> StoredItem | None:
        """The most recently stored item with this id (``item_reference``)."""

    @abstractmethod
    async def interrupt_unfinished(self, body_for: Any) -> int:
        """At start-up: responses left queued or in progress by a previous process can
        never finish. ``body_for(body_bytes, next_seq) -> (status, body_bytes, event)``
        rewrites each and gives the terminal event appended to its log at ``next_seq``,
        so that a replayed stream ends as every finished one does. Returns how many."""

    @abstractmethod
    async def request_cancel(self, response_id: str) -> None:
        """Ask whichever front end runs ``response_id`` to cancel it (a store several
        front ends share relays it; one that a single front end owns has nobody to ask)."""

    @abstractmethod
    async def watch_cancels(self, on_cancel: Callable[[str], None]) -> None:
        """Call ``on_cancel(response_id)`` (on the event loop) for each cancel another
        front end relays, until the store closes."""

    @abstractmethod
    async def secret(self, name: str) -> bytes:
        """A random 32-byte key named ``name``, made on first use and the same ever after
        for every front end sharing the store (it signs what the server hands clients to
        give back, such as compaction items)."""

    @abstractmethod
    async def close(self) -> None: ...

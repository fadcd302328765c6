"""Where ``/v1/responses`` keeps what it must find again: responses, their input items,
their output items and their event logs. ``ResponseStore`` is the interface;
``SqliteResponseStore`` the embedded default, ``PostgresResponseStore`` one database
that several front ends share."""

from .base import UNFINISHED, LoggedEvent, ResponseStore, StoredItem, StoredResponse
from .postgres import PostgresResponseStore
from .sqlite import SqliteResponseStore

__all__ = [
    "UNFINISHED",
    "LoggedEvent",
    "PostgresResponseStore",
    "ResponseStore",
    "SqliteResponseStore",
    "StoredItem",
    "StoredResponse",
]

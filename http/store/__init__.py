"""Where ``/v1/responses`` keeps what it must find again: responses, their input items,
their output items and their event logs. ``ResponseStore`` is the interface (a server
database can serve several front ends later); ``SqliteResponseStore`` the embedded
default."""

from .base import ResponseStore, StoredItem, StoredResponse
from .sqlite import SqliteResponseStore

__all__ = ["ResponseStore", "SqliteResponseStore", "StoredItem", "StoredResponse"]

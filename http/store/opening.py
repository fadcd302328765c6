"""Which store ``--responses-db`` names: a PostgreSQL URL, else an SQLite path."""

from __future__ import annotations

import sqlite3
from urllib.parse import urlsplit, urlunsplit

import anyio
import asyncpg

from .base import ResponseStore
from .postgres import PostgresResponseStore
from .sqlite import SqliteResponseStore

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


class StoreOpenError(Exception):
    """The store named could not be opened (unreachable, refused, not writable)."""


def is_postgres(target: str) -> bool:
    return target.startswith(POSTGRES_SCHEMES)


def redacted(target: str) -> str:
    """The target as it may be logged: a URL's password replaced by ``***``."""
    if not is_postgres(target):
        return target
    parts = urlsplit(target)
    if parts.password is None:
        return target
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


async def open_store(target: str, *, owner: str) -> ResponseStore:
    """``owner`` names this front end among those sharing a PostgreSQL database."""
    try:
        if is_postgres(target):
            with anyio.fail_after(30):
                return await PostgresResponseStore.connect(target, owner=owner)
        # Opening creates the file and its schema: off the event loop too.
        return await anyio.to_thread.run_sync(SqliteResponseStore, target)
    except (OSError, TimeoutError, sqlite3.Error, asyncpg.PostgresError,
            asyncpg.InterfaceError) as exc:  # fmt: skip
        raise StoreOpenError(f"{type(exc).__name__}: {exc}") from exc

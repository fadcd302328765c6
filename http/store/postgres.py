"""A PostgreSQL store, shared by several front ends (``--responses-db postgresql://…``).

* The same tables and semantics as the SQLite store; asyncpg's pool keeps every call on
  the event loop without threads.
* Several servers share one database, so each row records which front end ran it
  (``owner``: a name stable across that front end's restarts, its host and port by
  default). At start-up a front end marks unfinished only what it left unfinished
  itself: the others' responses are still running.
* Schema creation takes a transaction-scoped advisory lock: servers started together
  would otherwise race on ``CREATE TABLE IF NOT EXISTS``.
* A cancel that reaches a front end other than the one running the response travels
  as a ``NOTIFY`` on one channel; every front end ``LISTEN``s on a connection of its
  own, and the one running it cancels.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any

import asyncpg
import orjson
from asyncpg.pool import PoolConnectionProxy

from .base import (
    UNFINISHED,
    Item,
    LoggedEvent,
    Order,
    ResponseStore,
    StoredItem,
    StoredResponse,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at BIGINT NOT NULL,
    status TEXT NOT NULL,
    background BOOLEAN NOT NULL,
    owner TEXT NOT NULL,
    body BYTEA NOT NULL,
    history BYTEA NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_unfinished ON responses(owner, status);
CREATE TABLE IF NOT EXISTS items (
    response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
    kind TEXT NOT NULL,             -- 'input' or 'output'
    position INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    body BYTEA NOT NULL,
    stored BIGSERIAL,               -- insertion order: the newest copy of an item id wins
    PRIMARY KEY (response_id, kind, position)
);
CREATE INDEX IF NOT EXISTS items_by_id ON items(item_id);
CREATE TABLE IF NOT EXISTS events (
    response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    body BYTEA NOT NULL,
    PRIMARY KEY (response_id, seq)
);
-- Unix seconds when logged, NULL where unknown (a table made before events kept it).
ALTER TABLE events ADD COLUMN IF NOT EXISTS at DOUBLE PRECISION;
CREATE TABLE IF NOT EXISTS secrets (
    name TEXT PRIMARY KEY,
    value BYTEA NOT NULL
);
"""

CANCEL_CHANNEL = "sluice_response_cancel"
_SCHEMA_LOCK = 0x51_7C_E5_70  # any constant: the advisory lock's key for creating tables


def _item_rows(response_id: str, kind: str, items: Sequence[Item]) -> list[tuple[Any, ...]]:
    return [(response_id, kind, i, item["id"], orjson.dumps(item)) for i, item in enumerate(items)]


_INSERT_ITEMS = (
    "INSERT INTO items (response_id, kind, position, item_id, body) VALUES ($1, $2, $3, $4, $5)"
)


class PostgresResponseStore(ResponseStore):
    def __init__(self, pool: asyncpg.Pool, owner: str) -> None:
        self._pool = pool
        self.owner = owner
        self._listener: PoolConnectionProxy | None = None
        self._watchers: list[Callable[..., None]] = []

    @classmethod
    async def connect(cls, dsn: str, *, owner: str, max_size: int = 8) -> PostgresResponseStore:
        """Open a pool on ``dsn`` and create the tables if they are missing."""
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=max_size)
        try:
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _SCHEMA_LOCK)
                await conn.execute(_SCHEMA)
        except BaseException:
            await pool.close()
            raise
        return cls(pool, owner)

    # ------------------------------------------------------------------- writes

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
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO responses VALUES ($1, $2, $3, $4, $5, $6, $7)",
                response_id, created_at, status, background, self.owner, body,
                orjson.dumps(list(history)),
            )  # fmt: skip
            await conn.executemany(_INSERT_ITEMS, _item_rows(response_id, "input", input_items))

    async def update(
        self,
        response_id: str,
        *,
        status: str,
        body: bytes,
        output_items: Sequence[Item] | None = None,
    ) -> bool:
        async with self._pool.acquire() as conn, conn.transaction():
            updated = await conn.fetchval(
                "UPDATE responses SET status = $1, body = $2 WHERE id = $3 RETURNING 1",
                status, body, response_id,
            )  # fmt: skip
            if updated is None:
                return False
            if output_items is not None:
                await conn.execute(
                    "DELETE FROM items WHERE response_id = $1 AND kind = 'output'", response_id
                )
                await conn.executemany(
                    _INSERT_ITEMS, _item_rows(response_id, "output", output_items)
                )
            return True

    async def append_events(
        self, response_id: str, events: Sequence[tuple[int, bytes]], at: float | None = None
    ) -> None:
        if not events:
            return
        async with self._pool.acquire() as conn, conn.transaction():
            # Lock the row: a concurrent delete either waits for the log or removed it first.
            exists = await conn.fetchval(
                "SELECT 1 FROM responses WHERE id = $1 FOR SHARE", response_id
            )
            if exists is None:  # deleted while it ran: nothing to log against
                return
            await conn.executemany(
                "INSERT INTO events (response_id, seq, body, at) VALUES ($1, $2, $3, $4)",
                [(response_id, seq, body, at) for seq, body in events],
            )

    async def delete(self, response_id: str) -> bool:
        deleted = await self._pool.fetchval(
            "DELETE FROM responses WHERE id = $1 RETURNING 1", response_id
        )
        return deleted is not None

    async def interrupt_unfinished(self, body_for: Any) -> int:
        async with self._pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                "SELECT id, body FROM responses WHERE owner = $1 AND status = ANY($2::text[])"
                " FOR UPDATE",
                self.owner, list(UNFINISHED),
            )  # fmt: skip
            for row in rows:
                next_seq = await conn.fetchval(
                    "SELECT COALESCE(MAX(seq), -1) + 1 FROM events WHERE response_id = $1",
                    row["id"],
                )
                status, new_body, event = body_for(bytes(row["body"]), next_seq)
                await conn.execute(
                    "UPDATE responses SET status = $1, body = $2 WHERE id = $3",
                    status, new_body, row["id"],
                )  # fmt: skip
                await conn.execute(
                    "INSERT INTO events (response_id, seq, body) VALUES ($1, $2, $3)",
                    row["id"], next_seq, event,
                )  # fmt: skip
            return len(rows)

    # -------------------------------------------------------------------- reads

    async def get(self, response_id: str) -> StoredResponse | None:
        row = await self._pool.fetchrow(
            "SELECT status, background, body, history FROM responses WHERE id = $1",
            response_id,
        )
        if row is None:
            return None
        return StoredResponse(
            response_id,
            row["status"],
            row["background"],
            bytes(row["body"]),
            tuple(orjson.loads(row["history"])),
        )

    async def events(self, response_id: str, after: int) -> list[bytes]:
        rows = await self._pool.fetch(
            "SELECT body FROM events WHERE response_id = $1 AND seq > $2 ORDER BY seq",
            response_id, after,
        )  # fmt: skip
        return [bytes(row["body"]) for row in rows]

    async def timed_events(self, response_id: str) -> list[LoggedEvent]:
        rows = await self._pool.fetch(
            "SELECT body, at FROM events WHERE response_id = $1 ORDER BY seq", response_id
        )
        return [LoggedEvent(bytes(row["body"]), row["at"]) for row in rows]

    async def input_items(
        self, response_id: str, *, limit: int, order: Order, after: str | None
    ) -> tuple[list[Item], bool] | None:
        direction = "ASC" if order == "asc" else "DESC"
        compare = ">" if order == "asc" else "<"
        async with self._pool.acquire() as conn, conn.transaction(isolation="repeatable_read"):
            where, start = "", -1
            if after is not None:
                position = await conn.fetchval(
                    "SELECT position FROM items WHERE response_id = $1 AND kind = 'input'"
                    " AND item_id = $2 ORDER BY position LIMIT 1",
                    response_id, after,
                )  # fmt: skip
                if position is None:
                    return None
                where, start = f" AND position {compare} $3", position
            args: list[Any] = [response_id, limit + 1] + ([start] if after is not None else [])
            rows = await conn.fetch(
                "SELECT body FROM items WHERE response_id = $1 AND kind = 'input'"
                f"{where} ORDER BY position {direction} LIMIT $2",
                *args,
            )
        items = [orjson.loads(row["body"]) for row in rows[:limit]]
        return items, len(rows) > limit

    async def conversation(self, response_id: str) -> list[Item] | None:
        async with self._pool.acquire() as conn, conn.transaction(isolation="repeatable_read"):
            history = await conn.fetchval(
                "SELECT history FROM responses WHERE id = $1", response_id
            )
            if history is None:
                return None
            rows = await conn.fetch(
                "SELECT body FROM items WHERE response_id = $1 ORDER BY kind = 'output', position",
                response_id,
            )
        items: list[Item] = orjson.loads(history)
        return items + [orjson.loads(row["body"]) for row in rows]

    async def find_item(self, item_id: str) -> StoredItem | None:
        row = await self._pool.fetchrow(
            "SELECT items.response_id, items.body FROM items"
            " JOIN responses ON responses.id = items.response_id"
            " WHERE item_id = $1 ORDER BY responses.created_at DESC, items.stored DESC"
            " LIMIT 1",
            item_id,
        )
        if row is None:
            return None
        return StoredItem(row["response_id"], orjson.loads(row["body"]))

    # ------------------------------------------------------------------ cancels

    async def request_cancel(self, response_id: str) -> None:
        await self._pool.execute("SELECT pg_notify($1, $2)", CANCEL_CHANNEL, response_id)

    async def watch_cancels(self, on_cancel: Callable[[str], None]) -> None:
        if self._listener is None:
            # The pool's connections come and go; a listener needs one that stays.
            self._listener = await self._pool.acquire()

        def relayed(_conn: object, _pid: int, _channel: str, payload: object) -> None:
            on_cancel(str(payload))

        assert self._listener is not None
        await self._listener.add_listener(CANCEL_CHANNEL, relayed)
        self._watchers.append(relayed)

    async def secret(self, name: str) -> bytes:
        async with self._pool.acquire() as conn:
            await conn.execute(
                "INSERT INTO secrets (name, value) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
                name,
                secrets.token_bytes(32),
            )
            value = await conn.fetchval("SELECT value FROM secrets WHERE name = $1", name)
        return bytes(value)

    async def close(self) -> None:
        if self._listener is not None:
            for watcher in self._watchers:
                await self._listener.remove_listener(CANCEL_CHANNEL, watcher)
            self._watchers.clear()
            await self._pool.release(self._listener)
            self._listener = None
        await self._pool.close()

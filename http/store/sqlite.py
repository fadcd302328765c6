"""The embedded store: one SQLite database file (or ``:memory:``).

* Every call runs on a worker thread (``anyio.to_thread``): nothing blocks the loop.
* One writer connection behind a lock serialises writes; a file database runs in WAL
  mode, so readers (a small pool of their own connections) never wait for a writer
  and always see whole transactions. ``:memory:`` has one connection for everything.
* A response and its items are written in one transaction; deleting one removes its
  items and events with it.
"""

from __future__ import annotations

import secrets
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import orjson

from .base import (
    UNFINISHED,
    Item,
    LoggedEvent,
    Order,
    ResponseStore,
    StoredItem,
    StoredResponse,
)

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    status TEXT NOT NULL,
    background INTEGER NOT NULL,
    body BLOB NOT NULL,
    history BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS items (
    response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
    kind TEXT NOT NULL,             -- 'input' or 'output'
    position INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    body BLOB NOT NULL,
    PRIMARY KEY (response_id, kind, position)
);
CREATE INDEX IF NOT EXISTS items_by_id ON items(item_id);
CREATE TABLE IF NOT EXISTS events (
    response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    body BLOB NOT NULL,
    at REAL,                        -- Unix seconds when logged; NULL where unknown
    PRIMARY KEY (response_id, seq)
);
CREATE TABLE IF NOT EXISTS secrets (
    name TEXT PRIMARY KEY,
    value BLOB NOT NULL
);
"""

_READERS = 4


def _connect(target: str) -> sqlite3.Connection:
    conn = sqlite3.connect(target, check_same_thread=False, isolation_level=None, timeout=30)
    conn.execute("PRAGMA foreign_keys = ON")
    return conn


class SqliteResponseStore(ResponseStore):
    def __init__(self, path: str | Path) -> None:
        target = str(path)
        self.memory = target == ":memory:"
        if not self.memory:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
        self._writer = _connect(target)
        self._write_lock = threading.Lock()
        if not self.memory:
            self._writer.execute("PRAGMA journal_mode = WAL")
            self._writer.execute("PRAGMA synchronous = NORMAL")
        self._writer.executescript(_SCHEMA)
        columns = {row[1] for row in self._writer.execute("PRAGMA table_info(events)")}
        if "at" not in columns:  # a database written before events kept their time
            self._writer.execute("ALTER TABLE events ADD COLUMN at REAL")
        self._target = target
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ plumbing

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """The writer connection inside one transaction."""
        with self._write_lock:
            if self._closed:
                raise RuntimeError("the response store is closed")
            conn = self._writer
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """A reader connection (WAL: a consistent snapshot, never blocked by the writer);
        for ``:memory:``, the one connection under the writer's lock."""
        if self.memory:
            with self._write_lock:
                if self._closed:
                    raise RuntimeError("the response store is closed")
                yield self._writer
            return
        with self._readers_lock:
            conn = self._readers.pop() if self._readers else None
        if conn is None:
            conn = _connect(self._target)
        try:
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                conn.execute("COMMIT")
        finally:
            with self._readers_lock:
                if len(self._readers) < _READERS and not self._closed:
                    self._readers.append(conn)
                    conn = None
            if conn is not None:
                conn.close()

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(fn, *args)

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
        def work() -> None:
            with self._write() as conn:
                conn.execute(
                    "INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                    (response_id, created_at, status, int(background), body,
                     orjson.dumps(list(history))),
                )  # fmt: skip
                conn.executemany(
                    "INSERT INTO items VALUES (?, 'input', ?, ?, ?)",
                    [
                        (response_id, i, item["id"], orjson.dumps(item))
                        for i, item in enumerate(input_items)
                    ],
                )

        await self._run(work)

    async def update(
        self,
        response_id: str,
        *,
        status: str,
        body: bytes,
        output_items: Sequence[Item] | None = None,
    ) -> bool:
        def work() -> bool:
            with self._write() as conn:
                cur = conn.execute(
                    "UPDATE responses SET status = ?, body = ? WHERE id = ?",
                    (status, body, response_id),
                )
                if cur.rowcount == 0:
                    return False
                if output_items is not None:
                    conn.execute(
                        "DELETE FROM items WHERE response_id = ? AND kind = 'output'",
                        (response_id,),
                    )
                    conn.executemany(
                        "INSERT INTO items VALUES (?, 'output', ?, ?, ?)",
                        [
                            (response_id, i, item["id"], orjson.dumps(item))
                            for i, item in enumerate(output_items)
                        ],
                    )
                return True

        return await self._run(work)

    async def append_events(
        self, response_id: str, events: Sequence[tuple[int, bytes]], at: float | None = None
    ) -> None:
        if not events:
            return

        def work() -> None:
            with self._write() as conn:
                exists = conn.execute(
                    "SELECT 1 FROM responses WHERE id = ?", (response_id,)
                ).fetchone()
                if exists is None:  # deleted while it ran: nothing to log against
                    return
                conn.executemany(
                    "INSERT INTO events (response_id, seq, body, at) VALUES (?, ?, ?, ?)",
                    [(response_id, seq, body, at) for seq, body in events],
                )

        await self._run(work)

    async def delete(self, response_id: str) -> bool:
        def work() -> bool:
            with self._write() as conn:
                cur = conn.execute("DELETE FROM responses WHERE id = ?", (response_id,))
                return cur.rowcount > 0

        return await self._run(work)

    async def interrupt_unfinished(self, body_for: Any) -> int:
        def work() -> int:
            with self._write() as conn:
                rows = conn.execute(
                    "SELECT id, body FROM responses WHERE status IN (?, ?)", UNFINISHED
                ).fetchall()
                for response_id, body in rows:
                    (next_seq,) = conn.execute(
                        "SELECT COALESCE(MAX(seq), -1) + 1 FROM events WHERE response_id = ?",
                        (response_id,),
                    ).fetchone()
                    status, new_body, event = body_for(bytes(body), next_seq)
                    conn.execute(
                        "UPDATE responses SET status = ?, body = ? WHERE id = ?",
                        (status, new_body, response_id),
                    )
                    conn.execute(
                        "INSERT INTO events (response_id, seq, body) VALUES (?, ?, ?)",
                        (response_id, next_seq, event),
                    )
                return len(rows)

        return await self._run(work)

    # -------------------------------------------------------------------- reads

    async def get(self, response_id: str) -> StoredResponse | None:
        def work() -> StoredResponse | None:
            with self._read() as conn:
                row = conn.execute(
                    "SELECT status, background, body, history FROM responses WHERE id = ?",
                    (response_id,),
                ).fetchone()
            if row is None:
                return None
            status, background, body, history = row
            return StoredResponse(
                response_id, status, bool(background), bytes(body), tuple(orjson.loads(history))
            )

        return await self._run(work)

    async def events(self, response_id: str, after: int) -> list[bytes]:
        def work() -> list[bytes]:
            with self._read() as conn:
                rows = conn.execute(
                    "SELECT body FROM events WHERE response_id = ? AND seq > ? ORDER BY seq",
                    (response_id, after),
                ).fetchall()
            return [bytes(r[0]) for r in rows]

        return await self._run(work)

    async def timed_events(self, response_id: str) -> list[LoggedEvent]:
        def work() -> list[LoggedEvent]:
            with self._read() as conn:
                rows = conn.execute(
                    "SELECT body, at FROM events WHERE response_id = ? ORDER BY seq",
                    (response_id,),
                ).fetchall()
            return [LoggedEvent(bytes(body), at) for body, at in rows]

        return await self._run(work)

    async def input_items(
        self, response_id: str, *, limit: int, order: Order, after: str | None
    ) -> tuple[list[Item], bool] | None:
        direction = "ASC" if order == "asc" else "DESC"
        compare = ">" if order == "asc" else "<"

        def work() -> tuple[list[Item], bool] | None:
            with self._read() as conn:
                start: tuple[Any, ...] = ()
                where = ""
                if after is not None:
                    row = conn.execute(
                        "SELECT position FROM items WHERE response_id = ? AND kind = 'input'"
                        " AND item_id = ? ORDER BY position LIMIT 1",
                        (response_id, after),
                    ).fetchone()
                    if row is None:
                        return None
                    where, start = f" AND position {compare} ?", (row[0],)
                rows = conn.execute(
                    "SELECT body FROM items WHERE response_id = ? AND kind = 'input'"
                    f"{where} ORDER BY position {direction} LIMIT ?",
                    (response_id, *start, limit + 1),
                ).fetchall()
            items = [orjson.loads(r[0]) for r in rows[:limit]]
            return items, len(rows) > limit

        return await self._run(work)

    async def conversation(self, response_id: str) -> list[Item] | None:
        def work() -> list[Item] | None:
            with self._read() as conn:
                row = conn.execute(
                    "SELECT history FROM responses WHERE id = ?", (response_id,)
                ).fetchone()
                if row is None:
                    return None
                rows = conn.execute(
                    "SELECT body FROM items WHERE response_id = ?"
                    " ORDER BY kind = 'output', position",
                    (response_id,),
                ).fetchall()
            history: list[Item] = orjson.loads(row[0])
            return history + [orjson.loads(r[0]) for r in rows]

        return await self._run(work)

    async def find_item(self, item_id: str) -> StoredItem | None:
        def work() -> StoredItem | None:
            with self._read() as conn:
                row = conn.execute(
                    "SELECT items.response_id, items.body FROM items"
                    " JOIN responses ON responses.id = items.response_id"
                    " WHERE item_id = ? ORDER BY responses.created_at DESC, items.rowid DESC"
                    " LIMIT 1",
                    (item_id,),
                ).fetchone()
            if row is None:
                return None
            return StoredItem(row[0], orjson.loads(row[1]))

        return await self._run(work)

    # One front end owns the file: every run is local, there is nobody to relay to.

    async def request_cancel(self, response_id: str) -> None:
        return None

    async def watch_cancels(self, on_cancel: Callable[[str], None]) -> None:
        return None

    async def secret(self, name: str) -> bytes:
        def work() -> bytes:
            with self._write() as conn:
                conn.execute(
                    "INSERT OR IGNORE INTO secrets (name, value) VALUES (?, ?)",
                    (name, secrets.token_bytes(32)),
                )
                row = conn.execute("SELECT value FROM secrets WHERE name = ?", (name,)).fetchone()
            return bytes(row[0])

        return await self._run(work)

    async def close(self) -> None:
        def work() -> None:
            with self._write_lock:
                if self._closed:
                    return
                self._closed = True
                self._writer.close()
            with self._readers_lock:
                readers, self._readers = self._readers, []
            for conn in readers:
                conn.close()

        await self._run(work)

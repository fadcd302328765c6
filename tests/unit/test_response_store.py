"""The ``ResponseStore`` contract, run against every implementation: SQLite (a file) and
PostgreSQL (a real throwaway server). Each test opens stores through ``open_store``,
which gives a fresh database per test; a second ``open_store()`` is another process
(or another front end) on the same data."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest

from sluice.http.routes.responses import ResponsesService
from sluice.http.store import ResponseStore, SqliteResponseStore
from tests.conftest import StoreOpener


def message(item_id: str, text: str = "x") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "user", "content": [text]}


async def create(
    store: ResponseStore,
    rid: str,
    *,
    status: str = "completed",
    created_at: int = 1,
    inputs: tuple[str, ...] = (),
    history: tuple[str, ...] = (),
) -> None:
    await store.create(
        rid,
        created_at=created_at,
        status=status,
        background=status != "completed",
        body=orjson.dumps({"id": rid, "status": status}),
        history=[message(i) for i in history],
        input_items=[message(i) for i in inputs],
    )


def in_store(open_store: StoreOpener, work: Any) -> Any:
    async def go() -> Any:
        store = await open_store()
        try:
            return await work(store)
        finally:
            await store.close()

    return anyio.run(go)


def test_a_response_round_trips_byte_for_byte(open_store: StoreOpener) -> None:
    body = b'{"id":"resp_1","status":"queued","text":"\\u00e9 \xc3\xa9"}'

    async def work(store: ResponseStore) -> Any:
        await store.create("resp_1", created_at=5, status="queued", background=True,
                           body=body, history=[message("h1")], input_items=[])  # fmt: skip
        return await store.get("resp_1"), await store.get("resp_unknown")

    stored, unknown = in_store(open_store, work)
    assert unknown is None
    assert (stored.id, stored.status, stored.background, stored.body) == (
        "resp_1", "queued", True, body)  # fmt: skip
    assert stored.history == (message("h1"),)


def test_update_replaces_the_body_and_stores_the_output(open_store: StoreOpener) -> None:
    async def work(store: ResponseStore) -> Any:
        await create(store, "resp_1", status="in_progress", inputs=("in_1",))
        first = await store.update("resp_1", status="in_progress", body=b'{"step":1}')
        outputs = [message("out_1"), message("out_2")]
        final = await store.update("resp_1", status="completed", body=b'{"step":2}',
                                   output_items=outputs)  # fmt: skip
        again = await store.update("resp_1", status="completed", body=b'{"step":3}',
                                   output_items=outputs[:1])  # fmt: skip
        gone = await store.update("resp_unknown", status="completed", body=b"{}")
        return first, final, again, gone, await store.get("resp_1"), await store.conversation(
            "resp_1")  # fmt: skip

    first, final, again, gone, stored, conversation = in_store(open_store, work)
    assert (first, final, again, gone) == (True, True, True, False)
    assert (stored.status, stored.body) == ("completed", b'{"step":3}')
    assert [item["id"] for item in conversation] == ["in_1", "out_1"]


def test_event_logs_read_in_order_after_a_sequence_number(open_store: StoreOpener) -> None:
    async def work(store: ResponseStore) -> Any:
        await create(store, "resp_1", status="in_progress")
        await store.append_events("resp_1", [(0, b'{"n":0}'), (1, b'{"n":1}')])
        await store.append_events("resp_1", [])
        await store.append_events("resp_1", [(2, b'{"n":2}')])
        await store.append_events("resp_gone", [(0, b"{}")])  # deleted meanwhile: ignored
        return (await store.events("resp_1", -1), await store.events("resp_1", 1),
                await store.events("resp_1", 2), await store.events("resp_gone", -1))  # fmt: skip

    assert in_store(open_store, work) == (
        [b'{"n":0}', b'{"n":1}', b'{"n":2}'], [b'{"n":2}'], [], [])  # fmt: skip


def test_each_event_keeps_the_time_it_was_logged_beside_it(open_store: StoreOpener) -> None:
    """The clock is beside the events, never in them: the bytes read back are the bytes
    logged, whichever way they are read."""

    async def work(store: ResponseStore) -> Any:
        await create(store, "resp_1", status="in_progress")
        await store.append_events("resp_1", [(0, b'{"n":0}'), (1, b'{"n":1}')], at=1000.25)
        await store.append_events("resp_1", [(2, b'{"n":2}')])  # no clock given
        await store.append_events("resp_1", [(3, b'{"n":3}')], at=1001.5)
        return await store.timed_events("resp_1"), await store.events("resp_1", -1)

    timed, plain = in_store(open_store, work)
    assert [(e.body, e.at) for e in timed] == [
        (b'{"n":0}', 1000.25), (b'{"n":1}', 1000.25), (b'{"n":2}', None), (b'{"n":3}', 1001.5),
    ]  # fmt: skip
    assert plain == [e.body for e in timed]


def test_a_database_from_before_event_times_gains_the_column(tmp_path: Path) -> None:
    """A SQLite file written by a version whose event log kept no time opens, keeps its
    events (their time unknown), and logs new ones with theirs."""
    import sqlite3

    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(
        "CREATE TABLE responses (id TEXT PRIMARY KEY, created_at INTEGER NOT NULL,"
        " status TEXT NOT NULL, background INTEGER NOT NULL, body BLOB NOT NULL,"
        " history BLOB NOT NULL);"
        "CREATE TABLE events (response_id TEXT NOT NULL REFERENCES responses(id)"
        " ON DELETE CASCADE, seq INTEGER NOT NULL, body BLOB NOT NULL,"
        " PRIMARY KEY (response_id, seq));"
        "INSERT INTO responses VALUES ('resp_1', 1, 'in_progress', 1, x'7b7d', x'5b5d');"
        "INSERT INTO events VALUES ('resp_1', 0, x'7b7d');"
    )
    old.commit()
    old.close()

    async def go() -> Any:
        store = SqliteResponseStore(path)
        try:
            await store.append_events("resp_1", [(1, b"[]")], at=5.0)
            return await store.timed_events("resp_1")
        finally:
            await store.close()

    assert [(e.body, e.at) for e in anyio.run(go)] == [(b"{}", None), (b"[]", 5.0)]


def test_delete_removes_the_response_its_items_and_its_events(open_store: StoreOpener) -> None:
    async def work(store: ResponseStore) -> Any:
        await create(store, "resp_1", inputs=("in_1",))
        await store.append_events("resp_1", [(0, b"{}")])
        deleted, again = await store.delete("resp_1"), await store.delete("resp_1")
        return (deleted, again, await store.get("resp_1"), await store.events("resp_1", -1),
                await store.find_item("in_1"), await store.conversation("resp_1"))  # fmt: skip

    assert in_store(open_store, work) == (True, False, None, [], None, None)


def test_input_items_page_in_both_orders(open_store: StoreOpener) -> None:
    ids = tuple(f"in_{i}" for i in range(5))

    async def work(store: ResponseStore) -> Any:
        await create(store, "resp_1", inputs=ids)

        async def page(**kw: Any) -> Any:
            found = await store.input_items("resp_1", **kw)
            return None if found is None else ([i["id"] for i in found[0]], found[1])

        return [
            await page(limit=2, order="asc", after=None),
            await page(limit=2, order="asc", after="in_1"),
            await page(limit=2, order="asc", after="in_3"),
            await page(limit=10, order="desc", after=None),
            await page(limit=2, order="desc", after="in_2"),
            await page(limit=2, order="asc", after="in_unknown"),
        ]

    assert in_store(open_store, work) == [
        (["in_0", "in_1"], True),
        (["in_2", "in_3"], True),
        (["in_4"], False),
        (["in_4", "in_3", "in_2", "in_1", "in_0"], False),
        (["in_1", "in_0"], False),
        None,
    ]


def test_a_conversation_is_history_then_inputs_then_outputs(open_store: StoreOpener) -> None:
    async def work(store: ResponseStore) -> Any:
        await create(store, "resp_1", history=("h_0", "h_1"), inputs=("in_0",))
        await store.update("resp_1", status="completed", body=b"{}",
                           output_items=[message("out_0")])  # fmt: skip
        return await store.conversation("resp_1"), await store.conversation("resp_unknown")

    conversation, unknown = in_store(open_store, work)
    assert [item["id"] for item in conversation] == ["h_0", "h_1", "in_0", "out_0"]
    assert unknown is None


def test_find_item_gives_the_newest_copy(open_store: StoreOpener) -> None:
    async def work(store: ResponseStore) -> Any:
        await store.create("resp_old", created_at=1, status="completed", background=False,
                           body=b"{}", history=[], input_items=[message("dup", "old")])  # fmt: skip
        await store.create("resp_new", created_at=2, status="completed", background=False,
                           body=b"{}", history=[], input_items=[message("dup", "new")])  # fmt: skip
        return await store.find_item("dup"), await store.find_item("unknown")

    found, unknown = in_store(open_store, work)
    assert (found.response_id, found.item["content"]) == ("resp_new", ["new"])
    assert unknown is None


def test_concurrent_writers_and_readers_see_whole_transactions(open_store: StoreOpener) -> None:
    """Many responses written, appended to, read and deleted at once: every read sees
    whole transactions, and the end state is exactly what was written."""
    count, events_each = 40, 25

    async def one(store: ResponseStore, n: int, torn: list[str]) -> None:
        rid = f"resp_{n:04d}"
        items = [message(f"msg_{n}_{i}", str(i)) for i in range(3)]
        await store.create(rid, created_at=n, status="queued", background=True,
                           body=orjson.dumps({"n": n}), history=[], input_items=items)  # fmt: skip
        for seq in range(events_each):
            await store.append_events(rid, [(seq, orjson.dumps({"seq": seq}))])
            logged = await store.events(rid, -1)
            if [orjson.loads(e)["seq"] for e in logged] != list(range(len(logged))):
                torn.append(rid)
        await store.update(rid, status="completed", body=orjson.dumps({"n": n, "done": True}),
                           output_items=[{"id": f"msg_out_{n}", "type": "message"}])  # fmt: skip
        if n % 4 == 0:
            assert await store.delete(rid)

    async def work(store: ResponseStore) -> tuple[list[str], list[Any]]:
        torn: list[str] = []
        async with anyio.create_task_group() as tg:
            for n in range(count):
                tg.start_soon(one, store, n, torn)
        results = []
        for n in range(count):
            rid = f"resp_{n:04d}"
            stored = await store.get(rid)
            results.append((
                stored and orjson.loads(stored.body), len(await store.events(rid, -1)),
                await store.conversation(rid), await store.input_items(
                    rid, limit=100, order="asc", after=None),
            ))  # fmt: skip
        return torn, results

    torn, results = in_store(open_store, work)
    assert not torn
    for n, (body, events, conversation, page) in enumerate(results):
        if n % 4 == 0:
            assert body is None and events == 0 and conversation is None
            assert page == ([], False)
            continue
        assert body == {"n": n, "done": True} and events == events_each
        assert [i["id"] for i in conversation] == [f"msg_{n}_0", f"msg_{n}_1", f"msg_{n}_2",
                                                   f"msg_out_{n}"]  # fmt: skip


def test_a_reopened_store_marks_what_it_left_unfinished_failed(open_store: StoreOpener) -> None:
    """A restart (a new store on the same data, then the service's start-up sweep): the
    unfinished response is failed with a terminal event numbered on from its log; the
    finished one is untouched."""

    async def first() -> None:
        store = await open_store()
        body = orjson.dumps({"id": "resp_a", "status": "in_progress", "error": None})
        await store.create("resp_a", created_at=1, status="in_progress", background=True,
                           body=body, history=[], input_items=[])  # fmt: skip
        await store.append_events("resp_a", [(0, b"{}"), (1, b"{}")])
        await create(store, "resp_b")
        await store.close()

    async def second() -> Any:
        service = ResponsesService(await open_store())
        await service.start()
        found = (await service.store.get("resp_a"), await service.store.get("resp_b"),
                 await service.store.events("resp_a", 1))  # fmt: skip
        await service.close()
        return found

    anyio.run(first)
    a, b, tail = anyio.run(second)
    assert a.status == "failed" and b.status == "completed"
    body = orjson.loads(a.body)
    assert body["status"] == "failed" and body["error"]["code"] == "server_error"
    (event,) = [orjson.loads(e) for e in tail]
    assert (event["type"], event["sequence_number"]) == ("response.failed", 2)
    assert event["response"] == body


def test_a_secret_is_made_once_and_kept_across_reopens(open_store: StoreOpener) -> None:
    """The key that signs compaction items: random, one per name, the same after a
    restart and for every front end on the store, even when they ask at once."""

    async def first() -> tuple[bytes, bytes, list[bytes]]:
        a, b = await open_store(), await open_store()
        racing = await asyncio.gather(*(store.secret("compaction") for store in (a, b) * 4))
        other = await a.secret("other")
        key = await a.secret("compaction")
        await a.close()
        await b.close()
        return key, other, list(racing)

    async def again() -> bytes:
        store = await open_store()
        try:
            return await store.secret("compaction")
        finally:
            await store.close()

    key, other, racing = anyio.run(first)
    assert len(key) == len(other) == 32 and key != other
    assert set(racing) == {key}
    assert anyio.run(again) == key


@pytest.mark.parametrize("open_store", ["postgres"], indirect=True)
def test_front_ends_sharing_a_database_see_each_other_and_keep_their_own_runs(
    open_store: StoreOpener,
) -> None:
    """Two front ends on one PostgreSQL database: what one writes the other reads at
    once, and a restart of one fails only the responses it was running itself."""

    async def go() -> Any:
        a, b = await open_store(owner="a"), await open_store(owner="b")
        await create(a, "resp_a", status="in_progress", inputs=("in_a",))
        await create(b, "resp_b", status="in_progress")
        seen = (await b.get("resp_a"), await b.find_item("in_a"))
        await a.close()
        restarted = await open_store(owner="a")
        failed = await restarted.interrupt_unfinished(
            lambda body, seq: ("failed", b'{"status":"failed"}', b"{}")
        )
        statuses = [(await b.get(rid)).status for rid in ("resp_a", "resp_b")]  # type: ignore[union-attr]
        await restarted.close()
        await b.close()
        return seen, failed, statuses

    (stored, item), failed, statuses = anyio.run(go)
    assert stored.status == "in_progress" and item.response_id == "resp_a"
    assert failed == 1
    assert statuses == ["failed", "in_progress"]


def test_sqlite_calls_run_off_the_event_loop(tmp_path: Path) -> None:
    seen: list[str] = []

    class Watched(SqliteResponseStore):
        def _write(self) -> Any:  # type: ignore[override]
            seen.append(threading.current_thread().name)
            return super()._write()

    async def go() -> None:
        store = Watched(tmp_path / "db.sqlite3")
        await create(store, "resp_1", status="queued")
        await store.close()

    anyio.run(go)
    assert seen and threading.main_thread().name not in seen


def test_sqlite_in_memory_under_concurrent_use() -> None:
    """``:memory:`` has one connection for everything: the same load stays whole."""

    async def opener(owner: str = "a") -> Any:
        return SqliteResponseStore(":memory:")

    test_concurrent_writers_and_readers_see_whole_transactions(opener)

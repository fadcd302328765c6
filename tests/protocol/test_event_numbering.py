"""Live streams, recorded as they run (the fake engine, the real app and pipeline): every
request's lifecycle events are numbered 0, 1, 2, … in order and end with exactly one
terminal event, whether it completes, stops at its token limit, fails in the engine,
is cut by its client, or is a Responses stream whose client goes away. (Recorded and
replayed streams: ``test_replay``.)"""

from __future__ import annotations

from typing import Any

import anyio
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from sluice.events.recorder import MemoryRecorder, Recording
from sluice.events.types import (
    Cancelled,
    Completed,
    Failed,
    Incomplete,
    terminal_of,
)
from sluice.http.app import create_app
from tests.support.fake_engine import MODEL, FailingEngine, FakeEngine, fake_state


def recorded(
    tokenizer: Any, engine: FakeEngine, route: str, body: dict[str, Any], *, read: int | None
) -> Recording:
    """The recording of one request; ``read``: bytes the client reads before leaving."""
    state = fake_state(tokenizer, engine)
    recorder = MemoryRecorder()
    state.recorder = recorder

    async def go() -> None:
        client = TestClient(TestServer(create_app(state)))
        await client.start_server()
        try:
            resp = await client.post(route, json={"model": MODEL, **body})
            if read is None:
                await resp.read()
            else:
                await resp.content.readexactly(read)
                resp.close()  # the client goes away mid-stream
            with anyio.fail_after(10):
                while True:  # a recording is saved as its request ends, shielded
                    if recorder.saved:
                        break
                    await anyio.sleep(0.01)
        finally:
            await client.close()

    anyio.run(go)
    (recording,) = recorder.saved
    return recording


def assert_numbered(recording: Recording, terminal: type) -> None:
    events = recording.lifecycle_events
    assert [e.seq for e in events] == list(range(len(events)))
    ends = [e for e in events if terminal_of([e]) is not None]
    assert len(ends) == 1 and events[-1] is ends[0]
    assert isinstance(ends[0], terminal), ends[0]


CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
COMPLETIONS = ("/v1/completions", {"prompt": "Hi"})
RESPONSES = ("/v1/responses", {"input": "Hi"})


@pytest.mark.parametrize(("route", "body"), [CHAT, COMPLETIONS, RESPONSES])
@pytest.mark.parametrize("stream", [True, False])
def test_a_request_cut_at_its_limit_is_incomplete(
    tokenizer: Any, route: str, body: dict[str, Any], stream: bool
) -> None:
    limit = "max_output_tokens" if route == "/v1/responses" else "max_tokens"
    engine = FakeEngine(tokens=tokenizer.encode(" la"))
    recording = recorded(tokenizer, engine, route, {**body, limit: 16, "stream": stream}, read=None)
    assert_numbered(recording, Incomplete)


def test_a_request_that_ends_on_its_own_is_completed(tokenizer: Any) -> None:
    engine = FakeEngine(tokens=tokenizer.encode(" la"))
    body = {**CHAT[1], "max_tokens": 8, "stop": [" la la"]}
    assert_numbered(recorded(tokenizer, engine, CHAT[0], body, read=None), Completed)


@pytest.mark.parametrize(("route", "body"), [CHAT, COMPLETIONS, RESPONSES])
def test_an_engine_failure_ends_the_numbering(
    tokenizer: Any, route: str, body: dict[str, Any]
) -> None:
    engine = FailingEngine(tokens=tokenizer.encode(" la"))
    recording = recorded(tokenizer, engine, route, {**body, "stream": True}, read=None)
    assert_numbered(recording, Failed)


@pytest.mark.parametrize(("route", "body"), [CHAT, COMPLETIONS, RESPONSES])
def test_a_client_that_leaves_ends_the_numbering_with_cancelled(
    tokenizer: Any, route: str, body: dict[str, Any]
) -> None:
    engine = FakeEngine(tokens=tokenizer.encode(" la"), step_s=0.01)
    limit = "max_output_tokens" if route == "/v1/responses" else "max_tokens"
    recording = recorded(tokenizer, engine, route, {**body, limit: 2000, "stream": True}, read=200)
    assert_numbered(recording, Cancelled)
    end = recording.lifecycle_events[-1]
    assert isinstance(end, Cancelled) and "went away" in end.reason


def test_a_responses_recording_keeps_its_clock_reading(tokenizer: Any) -> None:
    """``completed_at`` is a clock reading: the recording's header keeps it, and replay
    gives it back, so the re-run is byte- and event-identical."""
    from sluice.pipeline.chat import ChatSetup
    from sluice.pipeline.token_text import TokenTexts
    from sluice.replay.cli import rerun

    engine = FakeEngine(tokens=tokenizer.encode(" la"))
    body = {**RESPONSES[1], "stop": [" la la"], "max_output_tokens": 16}
    recording = recorded(tokenizer, engine, RESPONSES[0], body, read=None)
    completed_at = orjson.loads(recording.output)["completed_at"]
    assert recording.clock == [completed_at]
    again = Recording.from_jsonl(recording.to_jsonl())
    assert again.clock == [completed_at]
    setup = ChatSetup.for_tokenizer(None, tokenizer)
    replayed = anyio.run(rerun, again, tokenizer, TokenTexts(tokenizer), setup)
    assert (replayed.output, replayed.lifecycle_events) == (
        recording.output,
        recording.lifecycle_events,
    )


@pytest.mark.parametrize("stream", [True, False])
def test_a_background_response_is_recorded_and_replays(tokenizer: Any, stream: bool) -> None:
    """A background run records like any other: its whole lifecycle (saved when it is
    over, after a unary request answered ``queued``) and the bytes the request got; the
    replay runs it to its end and matches both."""
    from sluice.pipeline.chat import ChatSetup
    from sluice.pipeline.token_text import TokenTexts
    from sluice.replay.cli import rerun

    engine = FakeEngine(tokens=tokenizer.encode(" la"))
    body = {**RESPONSES[1], "background": True, "stream": stream, "max_output_tokens": 16}
    recording = recorded(tokenizer, engine, RESPONSES[0], body, read=None)
    assert_numbered(recording, Incomplete)
    setup = ChatSetup.for_tokenizer(None, tokenizer)
    again = Recording.from_jsonl(recording.to_jsonl())
    replayed = anyio.run(rerun, again, tokenizer, TokenTexts(tokenizer), setup)
    assert (replayed.status, replayed.output) == (recording.status, recording.output)
    assert replayed.lifecycle_events == recording.lifecycle_events


def test_a_followed_background_run_is_recorded_whole_when_its_follower_leaves(
    tokenizer: Any,
) -> None:
    """The follower of a streamed background response leaves early; the run goes on,
    and the recording, saved once both are over, holds its whole lifecycle."""
    engine = FakeEngine(tokens=tokenizer.encode(" la"), step_s=0.005)
    body = {**RESPONSES[1], "background": True, "stream": True, "max_output_tokens": 200}
    recording = recorded(tokenizer, engine, RESPONSES[0], body, read=300)
    assert_numbered(recording, Incomplete)
    assert recording.lifecycle_events[-1].usage.completion_tokens == 200  # type: ignore[union-attr]

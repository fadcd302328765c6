"""The front end's writes to a worker wait on the socket's flow control (``Outbox``)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from sluice.dataparallel.outbox import Outbox

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


FRAME = 4096
FRAMES = 2000  # 8 MB: far beyond what the kernel and the transport buffer hold


async def test_frames_wait_in_the_outbox_while_the_worker_does_not_read() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    _, writer = await asyncio.open_unix_connection(sock=ours)
    theirs.setblocking(False)  # the worker's end, read only when the test says
    writer.transport.set_write_buffer_limits(high=64 * 1024)
    outbox = Outbox(writer)
    for i in range(FRAMES):
        outbox.send(i.to_bytes(4, "big") * (FRAME // 4))
        await asyncio.sleep(0)  # the writer task runs between sends, as between requests
    # Nobody reads: what the socket cannot take waits as frames, not in the transport.
    assert outbox.queued > FRAMES // 2
    assert writer.transport.get_write_buffer_size() < 4 * 1024 * 1024
    received = bytearray()
    while len(received) < FRAME * FRAMES:  # the worker catches up
        received += await asyncio.get_running_loop().sock_recv(theirs, 1 << 20)
    assert [
        int.from_bytes(received[i * FRAME : i * FRAME + 4], "big") for i in range(FRAMES)
    ] == list(range(FRAMES))
    assert outbox.queued == 0
    await outbox.close()
    writer.close()
    theirs.close()


async def test_a_closed_socket_ends_the_writer_quietly() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    _, writer = await asyncio.open_unix_connection(sock=ours)
    theirs.close()
    outbox = Outbox(writer)
    for _ in range(64):
        outbox.send(b"x" * 65536)
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)
    await outbox.close()  # no exception escapes
    writer.close()

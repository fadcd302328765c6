"""``engine/host_memory.py``: after ``keep_freed_memory`` a 64 MB tensor comes from
glibc's heap, where before it had a mapping of its own (which a step would fault in,
clear and unmap again), and so does a 68 MB one made on a thread started afterwards
(as the engine's step thread is), where before a thread's own arena mapped it; a
user's own ``MALLOC_*`` settings are left alone. The allocator's settings are the
process's, so the probes run in fresh ones."""

from __future__ import annotations

import subprocess
import sys

from sluice.engine.host_memory import keep_freed_memory

PROBE = """
import torch
from sluice.engine.host_memory import keep_freed_memory, mapped_chunks
def maps():
    before = mapped_chunks()
    tensor = torch.empty(16 << 20)  # 64 MB
    return mapped_chunks() - before
print(maps(), keep_freed_memory({}), maps(), sep="|")
"""


# A 68 MB tensor made on a new thread: how many mappings it added, without and with
# ``keep_freed_memory`` called first on the main thread.
THREAD_PROBE = """
import sys, threading, torch
from sluice.engine.host_memory import keep_freed_memory, mapped_chunks
if sys.argv[1] == "keep":
    keep_freed_memory({})
added = []
def allocate():
    torch.empty(1 << 20)  # the thread's first allocations
    before = mapped_chunks()
    tensor = torch.empty(17 << 20)  # 68 MB: more than a thread arena's 64 MB heap
    added.append(mapped_chunks() - before)
thread = threading.Thread(target=allocate)
thread.start()
thread.join()
print(added[0])
"""


def run(probe: str, *args: str) -> str:
    return subprocess.run(
        [sys.executable, "-P", "-c", probe, *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_large_tensors_come_from_the_heap() -> None:
    assert run(PROBE).split("|") == [
        "1",
        "allocations under 256 MB from the heap, 1024 MB of freed memory kept, "
        "one arena for every thread",
        "0",
    ]


def test_a_later_threads_large_tensors_come_from_the_heap() -> None:
    assert run(THREAD_PROBE, "default") == "1"
    assert run(THREAD_PROBE, "keep") == "0"


def test_the_users_settings_are_left_alone() -> None:
    said = keep_freed_memory({"MALLOC_MMAP_THRESHOLD_": "1048576"})
    assert said == "left to the environment's MALLOC_* / GLIBC_TUNABLES"

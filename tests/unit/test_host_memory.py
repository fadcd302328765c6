"""``engine/host_memory.py``: after ``keep_freed_memory`` a 64 MB tensor comes from
glibc's heap, where before it had a mapping of its own (which a step would fault in,
clear and unmap again); a user's own ``MALLOC_*`` settings are left alone. The
allocator's settings are the process's, so the first test runs in a fresh one."""

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


def test_large_tensors_come_from_the_heap() -> None:
    out = subprocess.run(
        [sys.executable, "-P", "-c", PROBE], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out.split("|") == [
        "1",
        "allocations under 256 MB from the heap, 1024 MB of freed memory kept",
        "0",
    ]


def test_the_users_settings_are_left_alone() -> None:
    said = keep_freed_memory({"MALLOC_MMAP_THRESHOLD_": "1048576"})
    assert said == "left to the environment's MALLOC_* / GLIBC_TUNABLES"

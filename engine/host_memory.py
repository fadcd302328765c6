"""glibc's allocator set for a serving process: large tensors from the heap, and the
memory they free kept for the next step.

By default glibc maps every allocation of 32 MB or more afresh and unmaps it when it is
freed, so a step's large tensors (at 64 rows of Gemma 3 the bf16 logits are 34 MB)
fault in and clear new pages every step: the kernel's page faults, page clearing and
unmapping were ≈10 % of a perf profile of Gemma 3 at C=64 on an Intel Xeon. Raising
the mapping threshold to 256 MB and the heap's trim threshold to 1 GB keeps those pages
in the process, at the cost of holding up to that much freed memory.

That alone does not reach an allocation of 64 MB or more from a thread other than the
main one: glibc gives other threads arenas of their own, which grow in 64 MB heaps, so
such an allocation is still mapped afresh. The engine steps on a thread of its own, and
Gemma 3's head output at 64 rows is 67 MB: the page faults, clearing and unmapping were
again 8.5 % of a profile at C=64 with AVX-512 alone. So every thread allocates from the
main heap (one arena): called before the process starts its threads (the command's
``main``), this holds for all of them; a thread that has allocated already keeps the
arena it has. A user's own ``MALLOC_*`` or ``GLIBC_TUNABLES`` settings are left as
they are.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 1 << 30
USER_SETTINGS = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_ARENA_MAX",
    "GLIBC_TUNABLES",
)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> str:
    """Set the thresholds; says what was done (for the start-up log)."""
    if any(name in environ for name in USER_SETTINGS):
        return "left to the environment's MALLOC_* / GLIBC_TUNABLES"
    libc = _glibc()
    if libc is None:
        return "not glibc: left as it is"
    if not (
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        and libc.mallopt(M_ARENA_MAX, 1)
    ):
        return "glibc refused the thresholds: left as it is"
    return (
        f"allocations under {MMAP_THRESHOLD >> 20} MB from the heap, "
        f"{TRIM_THRESHOLD >> 20} MB of freed memory kept, one arena for every thread"
    )


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def mapped_chunks() -> int | None:
    """How many allocations glibc holds as their own mappings now (``mallinfo2``'s
    ``hblks``); None where the C library is not glibc 2.33 or later."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):  # mallinfo2: glibc 2.33 and later
        return None
    libc.mallinfo2.restype = _MallInfo2
    return int(libc.mallinfo2().hblks)

"""Decode steps with fixed shapes, replayed from CUDA graphs on a GPU.

A decode step of a small model on a GPU is bound by launches, not by the GPU: some
four hundred kernels (30 layers of a dozen ops, the LM head), each a few µs of
Python and driver time, for microseconds of GPU work each. A CUDA graph replays the
whole step with one launch. A graph has fixed shapes and fixed addresses, so a step
is captured once per (batch bucket, read-length bucket) over static input buffers
that each step refills; rows that pad the batch up to its bucket run at position 0
(inside a learned position table: GPT-2, BioGPT), write their KV into the cache's
scratch position, and their logits are dropped.

Without capture (``capture=False``) the same fixed-shape step runs eagerly: that is
how the CPU tests check padding and bucketing against the plain decode path.
"""

from __future__ import annotations

import structlog
import torch

from .model_runner import ModelRunner

# Small batches are common and cheap to capture; larger ones step by 8, as SGLang.
_SMALL_BATCHES = (1, 2, 4, 8)
_MIN_READ_LEN = 128

log = structlog.get_logger(__name__)


def batch_bucket(rows: int, limit: int) -> int:
    """The captured batch size that ``rows`` rows run in: at most ``limit``."""
    for size in _SMALL_BATCHES:
        if rows <= size:
            return min(size, limit)
    return min(-(-rows // 8) * 8, limit)


def read_len_bucket(needed: int, capacity: int) -> int:
    """How many cache positions a captured step attends over: a power of two."""
    length = _MIN_READ_LEN
    while length < needed:
        length *= 2
    return min(length, capacity)


class StaticDecode:
    """Runs decode steps (decoder + LM head) at fixed shapes, captured on CUDA."""

    def __init__(self, runner: ModelRunner, *, max_batch: int, capture: bool) -> None:
        self.runner = runner
        self.cache = cache = runner.cache
        self.max_batch = max_batch
        self.capture = capture
        device = cache.device
        self._ids = torch.zeros(max_batch, 1, dtype=torch.long, device=device)
        # The model's positions, and where each row's KV is written: the same for a real
        # row; a padding row is at position 0 (inside any learned position table) and
        # writes at the scratch position.
        self._positions = torch.zeros(max_batch, 1, dtype=torch.long, device=device)
        self._write_positions = torch.zeros(max_batch, 1, dtype=torch.long, device=device)
        # Row r writes into slot r.
        self._write_rows = torch.arange(max_batch, device=device).unsqueeze(1)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._cache_identity: tuple[tuple[int, ...], int, int] | None = None
        self.captures = 0
        self.failed = False  # a capture failed: every later step runs eagerly
        self.steps = 0  # steps run at a fixed shape (the rest fell back to eager ones)

    def run(self, last_tokens: list[int], positions: list[int]) -> torch.Tensor | None:
        """Logits ``[rows, vocab]`` for rows ``0..len(last_tokens)`` of the cache, each
        writing its last token at its position; None where no fixed shape fits (the
        caller then steps eagerly)."""
        cache = self.cache
        rows = len(last_tokens)
        needed = max(positions) + 1
        limit = min(self.max_batch, cache.slots)
        if self.failed or rows > limit or needed > cache.capacity:
            return None
        # A resized cache lives at new addresses: graphs captured over the old one are void.
        identity = (cache.addresses(), cache.slots, cache.capacity)
        if identity != self._cache_identity:
            self._graphs.clear()
            self._cache_identity = identity
        key = (batch_bucket(rows, limit), read_len_bucket(needed, cache.capacity))
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._graphs[key] = self._prepare(*key)
            except RuntimeError as exc:
                # Capture wrote only scratch KV, so the eager step can take over.
                log.error("CUDA graph capture failed; decoding eagerly from now on", error=str(exc))
                self.failed = True
                return None
        graph, logits = entry
        batch = key[0]
        host = torch.zeros((3, batch), dtype=torch.long)
        host[0, :rows] = torch.tensor(last_tokens, dtype=torch.long)
        host[1, :rows] = host[2, :rows] = torch.tensor(positions, dtype=torch.long)
        host[2, rows:] = cache.scratch_position
        self._ids[:batch, 0].copy_(host[0], non_blocking=True)
        self._positions[:batch, 0].copy_(host[1], non_blocking=True)
        self._write_positions[:batch, 0].copy_(host[2], non_blocking=True)
        if graph is not None:
            graph.replay()
        else:
            logits = self._step(batch, key[1])
        self.steps += 1
        return logits[:rows]

    def _step(self, batch: int, read_len: int) -> torch.Tensor:
        positions = self._positions[:batch]
        self.cache.bind_static(self._write_rows[:batch], self._write_positions[:batch], read_len)
        runner = self.runner
        mask = runner.layout.masks(positions, read_len)
        hidden = runner.decode(self._ids[:batch], positions, mask)
        return runner.head(hidden[:, -1])

    def _prepare(
        self, batch: int, read_len: int
    ) -> tuple[torch.cuda.CUDAGraph | None, torch.Tensor]:
        if not self.capture:  # nothing to keep: ``run`` steps eagerly at this shape
            return None, torch.empty(0)
        # Warm-up and capture run with every row padding (writing only scratch KV), so
        # they touch no sequence's cache; the caller fills the real rows afterwards.
        self._write_positions[:batch].fill_(self.cache.scratch_position)
        self._positions[:batch].zero_()
        self._ids[:batch].zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(batch, read_len)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._step(batch, read_len)
        self.captures += 1
        return graph, logits

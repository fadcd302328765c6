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
how the CPU tests check padding and bucketing against the plain decode path. With
``compile=True`` (the CPU's ``--enable-torch-compile``) it runs compiled by inductor,
one compile per batch bucket (``compiled_step``).
"""

from __future__ import annotations

import time
from typing import Any

import structlog
import torch

from .compiled_step import compile_step, mark_cache_dynamic, mark_read_len_dynamic
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

    def __init__(
        self, runner: ModelRunner, *, max_batch: int, capture: bool, compile: bool = False
    ) -> None:
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
        self._compiled = compile_step(self._forward) if compile else None
        self.compiled_batches: set[int] = set()  # the buckets ``compile_buckets`` built

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
        if self._compiled is not None and batch_bucket(rows, limit) not in self.compiled_batches:
            return None  # never compiled while a request waits: this one steps eagerly
        # A resized cache lives at new addresses: graphs captured over the old one are void.
        identity = (cache.addresses(), cache.slots, cache.capacity)
        if identity != self._cache_identity:
            self._graphs.clear()
            self._cache_identity = identity
            if self._compiled is not None:
                mark_cache_dynamic(cache.storages)
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
        mask = self.runner.layout.masks(positions, read_len)
        step = self._forward
        if self._compiled is not None:
            mark_read_len_dynamic(mask.values() if isinstance(mask, dict) else [mask])
            step = self._compiled
        return step(
            self._ids[:batch], positions, self._write_rows[:batch], self._write_positions[:batch],
            mask,
        )  # fmt: skip

    def _forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        write_rows: torch.Tensor,
        write_positions: torch.Tensor,
        mask: Any,
    ) -> torch.Tensor:
        """The step itself (decoder and LM head): what is captured or compiled. It reads
        as many positions as the masks cover (a size, not a number, so that a compiled
        step takes any)."""
        masks = mask.values() if isinstance(mask, dict) else [mask]
        read_len = next(m for m in masks if m is not None).shape[-1]
        self.cache.bind_static(write_rows, write_positions, read_len)
        hidden = self.runner.decode(ids, positions, mask)
        return self.runner.head(hidden[:, -1])

    def compile_buckets(self) -> dict[int, float]:
        """Compile every batch bucket now, each with rows that only pad (writing only
        scratch KV), so that no request waits for one; seconds each, by bucket."""
        assert self._compiled is not None, "built without compile=True"
        cache = self.cache
        self._cache_identity = (cache.addresses(), cache.slots, cache.capacity)
        mark_cache_dynamic(cache.storages)
        limit = min(self.max_batch, cache.slots)
        read_len = read_len_bucket(1, cache.capacity)
        seconds: dict[int, float] = {}
        batch = 1
        while batch <= limit and batch not in seconds:
            self._write_positions[:batch].fill_(cache.scratch_position)
            self._positions[:batch].zero_()
            self._ids[:batch].zero_()
            begin = time.perf_counter()
            try:
                with torch.inference_mode():
                    self._step(batch, read_len)
            except Exception as exc:  # noqa: BLE001 - any failure of inductor's: step eagerly
                # The warm-up wrote only scratch KV, so the eager step can take over.
                log.error("torch_compile_failed; decoding eagerly", batch=batch, error=str(exc))
                self.failed = True
                break
            seconds[batch] = round(time.perf_counter() - begin, 1)
            self.compiled_batches.add(batch)
            log.info("decode_step_compiled", batch=batch, seconds=seconds[batch])
            batch = batch_bucket(batch + 1, limit)
        return seconds

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

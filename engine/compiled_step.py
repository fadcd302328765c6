"""Decode steps compiled by inductor on the CPU (``--enable-torch-compile``).

An eager one-row step of a small model is mostly Python, not arithmetic: thirty layers
of transformers' modules, each a dozen small ops (RMSNorm, rotary, casts, views), every
op a trip through the dispatcher. ``torch.compile`` traces the fixed-shape decode step
(``cuda_graphs.StaticDecode``) once per batch bucket, as SGLang's CPU graph runner
does, and inductor fuses the small ops into C++ kernels; the GEMMs (the packed GGUF
kernel, or torch's dense one), attention and the KV write stay the ops they are. The
KV write is the custom op ``sluice::write_kv`` so that it stays in place
(``kv_cache``).

The batch size is fixed per bucket (transformers' code specialises on it); the number
of cache positions a step reads, and the cache's own slots and capacity, are marked
dynamic, so that neither a longer sequence nor a grown cache compiles again.
inductor keeps what it built under ``models/cache/inductor`` (``TORCHINDUCTOR_CACHE_DIR``
where set), so that a later start traces the step but does not build it again."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch._dynamo
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from .cache_storage import LayerStorage
from .kv_cache import DenseKV

_CACHE_DIR_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
# A compile per batch bucket: room for every bucket of the largest ``--torch-compile-max-bs``.
_RECOMPILE_LIMIT = 64

Step = Callable[..., torch.Tensor]


def use_cache_dir(folder: Path) -> None:
    """Keep inductor's built kernels in ``folder``, unless the environment names a
    folder of its own. (torch writes its default, under /tmp, into the environment the
    first time it asks, which importing the engine does: that one is replaced.)"""
    current = os.environ.get(_CACHE_DIR_VARIABLE)
    if current is None or Path(current).absolute() == Path(default_cache_dir()).absolute():
        os.environ[_CACHE_DIR_VARIABLE] = str(folder.absolute())


def compile_step(step: Step) -> Step:
    """``step`` compiled, shapes as the module says (call ``mark_dynamic`` on its inputs)."""
    torch._dynamo.config.recompile_limit = max(
        torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT
    )
    compiled: Step = torch.compile(step, dynamic=None, fullgraph=False)
    return compiled


def mark_read_len_dynamic(masks: Iterable[torch.Tensor | None]) -> None:
    """A step's masks ``[rows, 1, 1, read_len]``: any read length, one compile."""
    for mask in masks:
        if mask is not None:
            torch._dynamo.mark_dynamic(mask, 3)


def mark_cache_dynamic(storages: Iterable[LayerStorage]) -> None:
    """The cache's slots and capacity (its storages' dims 1 and 3): a grown cache is
    read by the same compiled step. A dimension of size 1 stays specialised (torch
    always specialises it), so a cache grown from one slot compiles once more."""
    for storage in storages:
        if isinstance(storage, DenseKV):
            for tensor in (storage.k, storage.v):
                for dim in (1, 3):
                    if tensor.shape[dim] > 1:
                        torch._dynamo.mark_dynamic(tensor, dim)

"""How close a decode rate is to what the machine's memory allows (issue #28's report).

A decode step reads the model's weights once for all its rows, and each row's cached
keys and values; at C streams the rows of a step are C, so a token costs

    bytes per token = weight bytes ÷ C + cached positions × KV bytes a position

and the fraction of the bandwidth limit is tok/s × bytes per token ÷ the machine's
read bandwidth. The weight bytes are the GGUF's own (its tensors as the file stores
them: what llama-server reads, and the least any engine serving that file reads),
the embedding table counted only where it is the LM head too (otherwise a step reads
one row of it). The KV bytes are 16-bit (llama-server's f16 cache; Sluice's cache is
in the model's precision, so in fp32 it reads twice that). The cached positions are
the bench prompts' mean token count plus half the generated tokens. The bandwidth is
measured here: the best of a few sums over a buffer several times the last-level
cache, on the bench's threads.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sluice.bench.load_client import make_prompt
from sluice.engine.layer_kinds import cache_widths
from sluice.engine.packed_rows import last_level_cache_bytes

KV_ELEMENT_BYTES = 2  # a 16-bit cache
MIN_BUFFER_BYTES = 512 << 20
SAMPLE_PROMPTS = 64


def read_bandwidth(threads: int, repeats: int = 5) -> float:
    """Bytes a second the CPU reads from memory on ``threads`` threads: a sum over a
    buffer far larger than its caches, the best of ``repeats``."""
    import torch

    torch.set_num_threads(threads)
    cache = last_level_cache_bytes() or 0
    size = max(MIN_BUFFER_BYTES, 8 * cache)
    buffer = torch.ones(size // 4, dtype=torch.float32)
    buffer.sum()  # touch every page before timing
    seconds = []
    for _ in range(repeats):
        begin = time.perf_counter()
        buffer.sum()
        seconds.append(time.perf_counter() - begin)
    return size / min(seconds)


@dataclass(frozen=True)
class StepBytes:
    """What a decode step reads, as the module docstring counts it."""

    weights: int
    kv_per_position: int
    context: float

    def per_token(self, rows: int) -> float:
        return self.weights / max(1, rows) + self.context * self.kv_per_position

    def fraction(self, tok_per_s: float, rows: int, bandwidth: float) -> float:
        return tok_per_s * self.per_token(rows) / bandwidth


def gguf_weight_bytes(gguf: Path) -> int:
    """The file's tensor bytes a decode step reads: all of them, the embedding table
    only where no separate LM head (``output.weight``) exists."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def kv_bytes_per_position(config: Any) -> int:
    """What one position holds over every layer, 16-bit, in the widths the engine's cache
    writes (``layer_kinds.cache_widths``: each KV head's keys and values, or an MLA
    model's latent)."""
    heads, key_width, value_width = cache_widths(config)
    return int(config.num_hidden_layers) * heads * (key_width + value_width) * KV_ELEMENT_BYTES


def step_bytes(
    gguf: Path, folder: Path, tokenizer: Any, prompt_words: int, max_tokens: int
) -> StepBytes:
    """The bench's decode step on ``gguf`` (converted into ``folder``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder)).get_text_config()
    rng = random.Random(0)
    prompts = [make_prompt(rng, prompt_words) for _ in range(SAMPLE_PROMPTS)]
    prompt_tokens = statistics.mean(len(tokenizer.encode(p)) for p in prompts)
    return StepBytes(
        gguf_weight_bytes(gguf), kv_bytes_per_position(config), prompt_tokens + max_tokens / 2
    )


def record_entry(bandwidth: float, threads: int, step: StepBytes) -> dict[str, Any]:
    """What the suite's record keeps to report each row's fraction."""
    return {"read_bytes_per_s": bandwidth, "threads": threads, "step": asdict(step)}


def fraction_of(entry: dict[str, Any] | None, tok_per_s: float | None, rows: int) -> float | None:
    """A row's fraction of the bandwidth limit from a record's entry (None without one)."""
    if entry is None or tok_per_s is None:
        return None
    step = StepBytes(**entry["step"])
    return step.fraction(tok_per_s, rows, float(entry["read_bytes_per_s"]))

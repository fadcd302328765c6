"""The bench's fraction of the bandwidth limit (``bench/bandwidth.py``): what a token
reads, counted from a GGUF written here and a config; no model, no durations."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, quantize
from transformers import DeepseekV3Config, Gemma3TextConfig, LlamaConfig

from sluice.bench.bandwidth import (
    StepBytes,
    fraction_of,
    gguf_weight_bytes,
    kv_bytes_per_position,
    record_entry,
)


def _write(path: Path, names: list[str]) -> dict[str, int]:
    """A GGUF of Q8_0 tensors 32 × 64 under ``names``; each one's stored bytes."""
    writer = GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    sizes = {}
    for name in names:
        data = quantize(rng.standard_normal((32, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType.Q8_0)
        sizes[name] = data.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sizes


def test_a_tied_embedding_is_read_whole_as_the_head(tmp_path: Path) -> None:
    sizes = _write(tmp_path / "tied.gguf", ["token_embd.weight", "blk.0.ffn_up.weight"])
    assert gguf_weight_bytes(tmp_path / "tied.gguf") == sum(sizes.values())


def test_an_untied_embedding_is_one_row_a_token(tmp_path: Path) -> None:
    names = ["token_embd.weight", "blk.0.ffn_up.weight", "output.weight"]
    sizes = _write(tmp_path / "untied.gguf", names)
    expected = sizes["blk.0.ffn_up.weight"] + sizes["output.weight"]
    assert gguf_weight_bytes(tmp_path / "untied.gguf") == expected


def test_kv_bytes_count_every_layers_keys_and_values_in_16_bits() -> None:
    smollm2 = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          hidden_size=576)  # fmt: skip
    assert kv_bytes_per_position(smollm2) == 30 * 3 * (64 + 64) * 2
    gemma = Gemma3TextConfig(num_hidden_layers=18, num_attention_heads=4,
                             num_key_value_heads=1, hidden_size=640, head_dim=256)  # fmt: skip
    assert kv_bytes_per_position(gemma) == 18 * 1 * (256 + 256) * 2
    # MLA: one compressed latent and the shared rotary key a position, as the cache holds.
    mla = DeepseekV3Config(num_hidden_layers=2, kv_lora_rank=512, qk_rope_head_dim=64)
    assert kv_bytes_per_position(mla) == 2 * 1 * (512 + 64) * 2


def test_the_weights_are_shared_by_a_steps_rows_and_the_cache_is_not() -> None:
    step = StepBytes(weights=96_000_000, kv_per_position=23_040, context=130.0)
    assert step.per_token(1) == pytest.approx(96e6 + 130 * 23_040)
    assert step.per_token(64) == pytest.approx(96e6 / 64 + 130 * 23_040)
    # 50 tok/s at one row reads ≈ 4.95 GB/s: half of a 9.9 GB/s machine.
    assert step.fraction(50.0, 1, 9.9e9) == pytest.approx(0.5, rel=0.01)
    entry = record_entry(9.9e9, 2, step)
    assert fraction_of(entry, 50.0, 1) == pytest.approx(step.fraction(50.0, 1, 9.9e9))
    assert fraction_of(None, 50.0, 1) is None and fraction_of(entry, None, 1) is None

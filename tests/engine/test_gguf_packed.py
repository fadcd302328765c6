"""``--quantization gguf`` on the two real GGUF files: which linears are packed (every
one of a packable type, the tied LM head included), that each packed weight is exactly
the one transformers de-quantised from the same file (so names and row orders line up:
LLaMA's q and k are stored permuted), Gemma's re-quantised Q6_K within one 8-bit step
of it and its reported distance small, and that the blocks kept beside the converted
model read back the same. The served tokens are tested end to end
(``tests/e2e/test_e2e_quantization.py``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sluice.engine.errors import ModelLoadError
from sluice.engine.fused_projections import ProjectionMember, quantization_of
from sluice.engine.gguf_blocks import read_gguf_tensors
from sluice.engine.gguf_packed import CACHE_FILE, block_tensors, pack_model
from sluice.engine.loader import load_causal_lm, resolve_model
from sluice.engine.quantization import choose_quantization
from tests.conftest import DEFAULT_GGUF, GEMMA_GGUF, missing_model

pytestmark = pytest.mark.model

# What each file holds in its linears (the head included), packed and left dense, as
# its tensor types say; and the packable tensors decoded (the tied embedding is one).
EXPECTED = {
    DEFAULT_GGUF: ({"Q4_1": 210, "Q8_0": 1}, {}, {"Q4_1": 210, "Q8_0": 1}),
    GEMMA_GGUF: (
        {"Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 10},
        {},
        {"Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 10},
    ),
}
# The most Q6_K's re-quantisation may move Gemma's weights, relative RMS: an 8-bit step
# is a quarter of the coarser of a group's two 6-bit steps, so the distance is a small
# fraction of Q6_K's own rounding (what it comes to is in docs/benchmarks.md).
Q6_K_DISTANCE = 0.01


def _model(gguf: Path) -> tuple[Any, Path]:
    if not gguf.exists():
        missing_model(f"{gguf.name} missing: run `make model model-gemma`")
    resolved = resolve_model(gguf)
    return load_causal_lm(resolved.folder, dtype="float32", device="cpu"), resolved.folder


@pytest.mark.parametrize("gguf", sorted(EXPECTED), ids=lambda p: p.name)
def test_every_packable_linear_is_packed_and_nothing_else(gguf: Path) -> None:
    model, folder = _model(gguf)
    assert quantization_of(model) is None
    report = pack_model(model, folder, gguf)
    assert (report.packed, report.dense) == EXPECTED[gguf][:2]
    assert set(report.requantised) == set(report.packed) & {"Q6_K"}
    assert all(0 < distance < Q6_K_DISTANCE for distance in report.requantised.values())
    assert quantization_of(model) == "gguf"
    members = [m for m in model.modules() if isinstance(m, ProjectionMember)]
    assert len(members) == sum(report.packed.values())
    assert isinstance(model.get_output_embeddings(), ProjectionMember)  # the head too


@pytest.mark.parametrize("gguf", sorted(EXPECTED), ids=lambda p: p.name)
def test_packed_weights_are_the_files_own(gguf: Path, tmp_path: Path) -> None:
    """Decoded straight from the file (no cache), each packable weight's planes sum to
    transformers' de-quantisation of it exactly (a re-quantised one's within its
    bound); the cache written from them reads back bit for bit."""
    model, _ = _model(gguf)
    decoded = read_gguf_tensors(gguf, model)
    weights = dict(model.named_parameters())
    assert Counter(w.file_type for w in decoded.packable.values()) == EXPECTED[gguf][2]
    for name, weight in decoded.packable.items():
        loaded = weights[name].detach().numpy()
        if weight.requantised:
            assert np.all(np.abs(weight.dequantize() - loaded) <= weight.requantisation_bound())
        else:
            np.testing.assert_array_equal(weight.dequantize(), loaded)
    kept = block_tensors(model, tmp_path, gguf)  # decodes, checks and writes the cache
    assert (tmp_path / CACHE_FILE).is_file()
    again = block_tensors(model, tmp_path, gguf)  # reads it back
    assert again.types == kept.types == decoded.types
    for name, weight in decoded.packable.items():
        read = again.packable[name]
        assert read.file_type == weight.file_type
        assert (read.squared_error, read.squared_norm) == (
            weight.squared_error,
            weight.squared_norm,
        )
        for plane, read_plane in zip(weight.planes, read.planes, strict=True):
            for part in ("codes", "scale", "zero"):
                np.testing.assert_array_equal(getattr(read_plane, part), getattr(plane, part))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_first_start_checks_a_model_loaded_in_half_precision(
    dtype: str, tmp_path: Path
) -> None:
    """``make run`` on a fresh machine whose ``--dtype auto`` takes bf16 decodes the
    blocks first against a bf16 model: the check rounds the decoded weights as the
    model was rounded, passes, and writes the cache; a wrong row order still fails."""
    resolved = resolve_model(DEFAULT_GGUF)
    model = load_causal_lm(resolved.folder, dtype=dtype, device="cpu")
    tensors = block_tensors(model, tmp_path, DEFAULT_GGUF)
    assert (tmp_path / CACHE_FILE).is_file() and len(tensors.packable) == 211
    name = "model.layers.0.self_attn.q_proj.weight"
    weight = dict(model.named_parameters())[name]
    with torch.no_grad():
        weight.copy_(weight.flip(0))  # rows out of order, as a wrong permutation would be
    (tmp_path / CACHE_FILE).unlink()
    with pytest.raises(ModelLoadError, match=f"{name} read from .* does not match"):
        block_tensors(model, tmp_path, DEFAULT_GGUF)


def test_the_default_is_chosen_from_the_files_types() -> None:
    types = resolve_model(DEFAULT_GGUF).matrix_types
    assert types == {"Q4_1", "Q8_0"}
    chosen = choose_quantization(None, DEFAULT_GGUF, types, "cpu")
    assert (chosen.method, chosen.reason) == ("gguf", "a GGUF file of Q4_1, Q8_0 weights")
    assert choose_quantization(None, DEFAULT_GGUF, types, "cuda").method == "none"
    assert choose_quantization(None, DEFAULT_GGUF, frozenset({"F16"}), "cpu").method == "none"
    assert choose_quantization("none", DEFAULT_GGUF, types, "cpu").method == "none"
    folder = resolve_model(DEFAULT_GGUF).folder
    assert choose_quantization(None, folder, frozenset(), "cpu").method == "none"
    with pytest.raises(ModelLoadError, match="holds F16"):
        choose_quantization("gguf", DEFAULT_GGUF, frozenset({"F16"}), "cpu")
    with pytest.raises(ModelLoadError, match="runs on the CPU"):
        choose_quantization("gguf", DEFAULT_GGUF, types, "cuda")


def test_a_damaged_cache_is_decoded_again(tmp_path: Path) -> None:
    """A cache file cut short (a crash while writing, a full disk) is read as missing:
    the blocks are decoded from the file again and the cache written whole."""
    model, _ = _model(DEFAULT_GGUF)
    kept = block_tensors(model, tmp_path, DEFAULT_GGUF)
    cache = tmp_path / CACHE_FILE
    cache.write_bytes(cache.read_bytes()[:1000])
    again = block_tensors(model, tmp_path, DEFAULT_GGUF)
    assert again.types == kept.types and sorted(again.packable) == sorted(kept.packable)
    assert block_tensors(model, tmp_path, DEFAULT_GGUF).types == kept.types  # whole again
    assert [p.name for p in tmp_path.iterdir()] == [CACHE_FILE]  # no staging file left

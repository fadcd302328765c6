"""The layer-kind seam: a new kind of decoder layer is one ``LayerKind`` (what its
queries see, and how its cache is laid out), registered in ``LAYER_KINDS``.

The kind added here, in the test, keeps its keys and values positions-major
(``[slots, positions, layers, kv_heads, head_dim]``, unlike the dense layout's
layers-major) and builds its own masks (every earlier position, as the model's code
attends). A Llama whose config names that kind for every layer (Llama's code reads no
layer types) is served through it — the slot table's copies and swaps, chunked
prefill, mixed steps and prefix reuse — with ``model.generate``'s greedy tokens and
logprobs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from sluice.engine import layer_kinds
from sluice.engine.attention import AttentionLayout
from sluice.engine.cache_storage import Binding, LayerStorage
from sluice.engine.errors import UnsupportedModelError
from sluice.engine.layer_kinds import LayerKind
from sluice.engine.loader import load_causal_lm
from tests.support.scheduling import (
    BASE,
    Events,
    add,
    drain,
    generate,
    prompt,
    scheduler,
)

# A layer type transformers accepts in a config and Sluice has no kind for.
TOY = "window_attention"


class PositionsMajorKV(LayerStorage):
    """Keys and values as ``[slots, capacity + 1, layers, kv_heads, head_dim]``."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 slots: int, capacity: int) -> None:  # fmt: skip
        self.dims = (layers, kv_heads, head_dim)
        self.dtype = dtype
        self.k = torch.zeros(slots, capacity + 1, *self.dims, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.updates = 0

    def bytes_for(self, slots: int, capacity: int) -> int:
        per_position = self.dims[0] * self.dims[1] * self.dims[2] * self.k.element_size()
        return 2 * slots * (capacity + 1) * per_position

    def resize(self, slots: int, capacity: int) -> None:
        keep_s, keep_c = min(slots, self.k.shape[0]), min(capacity + 1, self.k.shape[1])
        for name in ("k", "v"):
            new = torch.zeros(slots, capacity + 1, *self.dims, dtype=self.dtype)
            new[:keep_s, :keep_c] = getattr(self, name)[:keep_s, :keep_c]
            setattr(self, name, new)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        self.k[dst, :length] = self.k[src, :length]
        self.v[dst, :length] = self.v[src, :length]

    def swap(self, a: int, b: int, length: int) -> None:
        for t in (self.k, self.v):
            held = t[a, :length].clone()
            t[a, :length] = t[b, :length]
            t[b, :length] = held

    def update(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, binding: Binding
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.updates += 1
        # key [rows, kv, T, hd] → [rows, T, kv, hd], written at (slot, position).
        self.k[binding.row_index, binding.positions, layer] = key.transpose(1, 2)
        self.v[binding.row_index, binding.positions, layer] = value.transpose(1, 2)
        # Attention reads [slots, kv, positions, hd].
        k = self.k[:, :, layer].transpose(1, 2)
        v = self.v[:, :, layer].transpose(1, 2)
        if binding.rows is None:
            return k, v
        return k[binding.rows, :, : binding.read_len], v[binding.rows, :, : binding.read_len]

    def addresses(self) -> tuple[int, ...]:
        return (self.k.data_ptr(), self.v.data_ptr())


class ToyKind(LayerKind):
    """Causal attention, with its own layout and its own masks (counted)."""

    name = TOY
    storages: ClassVar[list[PositionsMajorKV]] = []
    masks = 0

    def visible(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        ToyKind.masks += 1
        return keys <= queries

    def storage(self, config: Any, layers: int, *, dtype: torch.dtype, device: torch.device,
                slots: int, capacity: int) -> LayerStorage:  # fmt: skip
        storage = PositionsMajorKV(layers, config.num_key_value_heads, config.head_dim, dtype,
                                   slots, capacity)  # fmt: skip
        self.storages.append(storage)
        return storage


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama whose config names the toy kind for every layer."""
    folder: Path = tmp_path_factory.mktemp("toy")
    config = AutoConfig.for_model("llama", **BASE, layer_types=[TOY] * BASE["num_hidden_layers"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, attn_implementation="eager").save_pretrained(folder)
    return folder


def load(folder: Path) -> Any:
    model = load_causal_lm(folder, dtype="float32", device="cpu")
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def toy_model(folder: Path) -> Any:
    return load(folder)


@pytest.fixture(scope="module")
def reference(folder: Path) -> Any:
    """The same weights for ``model.generate``, whose cache knows only transformers'
    own layer types: Llama's code attends the same whatever the config names."""
    model = load(folder)
    model.config.layer_types = None
    return model


def test_an_unregistered_kind_is_refused(toy_model: Any) -> None:
    with pytest.raises(UnsupportedModelError, match=f"has {TOY} layers"):
        AttentionLayout.for_model(toy_model)


def test_a_kind_added_in_a_test_serves_a_model(
    toy_model: Any, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(layer_kinds.LAYER_KINDS, TOY, ToyKind)
    ToyKind.storages.clear()
    ToyKind.masks = 0
    prompts = {"a": prompt(21, 37), "b": prompt(22, 6), "c": prompt(21, 37)[:30] + prompt(23, 9)}
    sch, events = scheduler(model=toy_model, mixed_chunk=True), Events()
    add(sch, events, "a", prompts["a"], logprobs=0)
    add(sch, events, "b", prompts["b"], logprobs=0)
    for _ in range(6):  # a's 37 prompt tokens are in, 7 a step
        sch.step(events)
    add(sch, events, "c", prompts["c"], logprobs=0)  # shares a's first 30 tokens
    drain(sch, events)
    (storage,) = ToyKind.storages
    assert storage.updates > 0 and ToyKind.masks > 0 and sch.mixed_steps > 0
    assert events.cached("c") == 30
    for rid, ids in prompts.items():
        tokens, logprobs = generate(reference, ids)
        assert events.tokens(rid) == tokens, rid
        assert events.logprobs(rid) == pytest.approx(logprobs, abs=1e-4), rid

"""The direct decode step (``engine/direct_decode.py``) against transformers' layers.

Tiny random models of each family it serves, in float32 and unquantised (so that the
two paths differ by summing order alone): three rows at different positions, two of
them past the sliding window (8), step once through each path; the hidden states, and
the keys and values each writes into the cache, must agree. Families it does not
serve are refused with their layer named."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from sluice.engine import packed
from sluice.engine.assembly import build_scheduler
from sluice.engine.direct_decode import LAYERS, DirectDecode, NotDirect, check
from sluice.engine.gguf_packed import pack_model
from sluice.engine.loader import load_causal_lm, load_tokenizer, resolve_model
from sluice.engine.model_runner import TokenRun
from sluice.engine.native_kernels import planes_kernel
from sluice.engine.scheduler import SchedulerConfig
from tests.conftest import DEFAULT_GGUF, missing, missing_model
from tests.support.choice_events import Events
from tests.support.following import assert_runs_follow, serve_joining, steps_of
from tests.support.scheduling import build, prompt, scheduler

SERVED = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
LENGTHS = (29, 11, 3)  # cached positions per row: two rows past the window


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    unavailable = planes_kernel()
    if unavailable is not None:
        missing(f"Sluice's kernels are not built here: {unavailable}")


def _runner_with_rows(model: Any) -> Any:
    """A runner whose slots 0..2 hold prompts of ``LENGTHS``."""
    runner = scheduler(model).runner
    runner.cache.resize(4, 64)
    for slot, n in enumerate(LENGTHS):
        ids = torch.tensor([prompt(slot, n)])
        runner.forward(slice(slot, slot + 1), ids, torch.arange(n).unsqueeze(0))
    return runner


@pytest.mark.parametrize("name", SERVED)
@torch.inference_mode()
def test_a_step_equals_transformers_layers(name: str, tmp_path: Path) -> None:
    model = build(name, tmp_path)
    runner = _runner_with_rows(model)
    assert runner.direct is None, "an unquantised model keeps transformers' layers"
    direct = DirectDecode.build(model, runner.decoder, runner.cache, runner.layout)
    ids = torch.tensor([5, 17, 301])
    positions = torch.tensor(LENGTHS)
    expected = runner.forward(slice(0, 3), ids.unsqueeze(1), positions.unsqueeze(1))[:, -1]
    storages = runner.cache.storages
    written = [(s.k.clone(), s.v.clone()) for s in storages]
    for storage in storages:  # the direct step must write these positions itself
        for layer_cache in (storage.k, storage.v):
            layer_cache[:, torch.arange(3), :, positions] = 0
    got = direct.hidden(ids, positions)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for storage, (k, v) in zip(storages, written, strict=True):
        torch.testing.assert_close(storage.k, k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(storage.v, v, rtol=1e-5, atol=1e-5)
    logits = runner.head(got)
    assert logits.argmax(-1).tolist() == runner.head(expected).argmax(-1).tolist()
    assert check(runner, direct) < 1e-3


@pytest.mark.parametrize("name", SERVED)
@pytest.mark.parametrize("chunk_start", [0, 200])
@torch.inference_mode()
def test_a_packed_step_takes_the_direct_steps_attention(
    name: str, chunk_start: int, tmp_path: Path
) -> None:
    """Where the direct step serves the layers, a packed step's tokens attend through its
    op (``packed.OwnAttention``), each over its own slot up to its own position: decode
    rows (one with a three-token draft), a chunk continuing a cached prompt and one
    starting at ``chunk_start``. Short, the whole step is the direct step's; a chunk read
    past ``OWN_ATTENTION_READS`` keeps transformers' layers and SDPA, its decode rows the
    op. Either way the hidden states, and the keys and values written, are SDPA's."""
    model = build(name, tmp_path)
    runner = _runner_with_rows(model)
    runner.cache.resize(4, 256)
    direct = DirectDecode.build(model, runner.decoder, runner.cache, runner.layout)
    groups = [
        (0, [TokenRun(LENGTHS[0], [5, 6, 7]), TokenRun(LENGTHS[1], [17])]),
        (2, [TokenRun(LENGTHS[2], prompt(7, 6)), TokenRun(chunk_start, prompt(8, 10))]),
    ]
    assert packed.takes_own(10, chunk_start + 10) is (chunk_start == 0)
    storages = runner.cache.storages
    cached = [(s.k.clone(), s.v.clone()) for s in storages]
    outputs, written = [], []
    for path in (None, direct):
        for storage, (k, v) in zip(storages, cached, strict=True):
            storage.k.copy_(k)
            storage.v.copy_(v)
        runner.direct = path
        outputs.append(runner.forward_packed(groups))
        written.append([(s.k.clone(), s.v.clone()) for s in storages])
    for sdpa, own in zip(*outputs, strict=True):
        torch.testing.assert_close(own, sdpa, rtol=1e-4, atol=1e-4)
    for (k_sdpa, v_sdpa), (k_own, v_own) in zip(*written, strict=True):
        torch.testing.assert_close(k_own, k_sdpa, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v_own, v_sdpa, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_a_wrong_layer_is_caught_by_the_check(tmp_path: Path) -> None:
    """The check refuses a direct step that computes something else past its tolerance:
    here, one whose second layer scales its attention scores four times over (a random tiny
    model's logits are flat, so the tolerance is an unquantised float32 model's)."""
    model = build("llama", tmp_path)
    runner = _runner_with_rows(model)
    direct = DirectDecode.build(model, runner.decoder, runner.cache, runner.layout)
    assert check(runner, direct, tolerance=0.05) < 1e-3
    layers = list(direct.layers)
    layers[1] = dataclasses.replace(layers[1], scale=layers[1].scale * 4)
    with pytest.raises(NotDirect, match="differ from transformers' layers'"):
        check(runner, direct.with_layers(layers), tolerance=0.05)


@pytest.mark.parametrize("name", ["phi3", "gemma2", "olmo2"])
def test_other_families_are_refused_by_name(name: str, tmp_path: Path) -> None:
    model = build(name, tmp_path)
    runner = scheduler(model).runner
    layer = type(runner.decoder.layers[0]).__name__
    assert layer not in LAYERS
    with pytest.raises(NotDirect, match=layer):
        DirectDecode.build(model, runner.decoder, runner.cache, runner.layout)


def _packed_default(dtype: str) -> tuple[Any, Any]:
    if not DEFAULT_GGUF.exists():
        missing_model("default model missing: run `make model`")
    resolved = resolve_model(DEFAULT_GGUF)
    model = load_causal_lm(resolved.folder, dtype=dtype, device="cpu")
    pack_model(model, resolved.folder, DEFAULT_GGUF)
    return load_tokenizer(resolved.folder), model


@pytest.mark.model
def test_the_default_model_served_packed_decodes_directly() -> None:
    """The default model as served (its GGUF packed, bfloat16 around) chooses the direct
    step; its greedy runs, sequences joining mid-way, follow transformers' layers' up
    to a near-tie; and a direct step gone wrong (its attention scores scaled four
    times over) is refused by the start-up check."""
    tok, model = _packed_default("bfloat16")
    config = SchedulerConfig(max_running=8, context_length=2048, initial_capacity=32)
    sch = build_scheduler(model, config, eos_token_ids=frozenset({2}), device=torch.device("cpu"))
    direct = sch.runner.direct
    assert direct is not None
    assert sch.runner.decode_path is not None and sch.runner.decode_path.path == "direct"
    outputs = []
    for path in (None, direct):
        sch.runner.direct = path
        events = Events()
        serve_joining(sch, tok, events)
        outputs.append({rid: steps_of(events, rid) for rid, _ in events.by_key})
    layers, direct_steps = outputs
    assert_runs_follow(direct_steps, layers)
    wrong = direct.with_layers(
        [dataclasses.replace(layer, scale=layer.scale * 4) for layer in direct.layers]
    )
    with pytest.raises(NotDirect, match="differ from transformers' layers'"):
        check(sch.runner, wrong)

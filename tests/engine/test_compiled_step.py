"""``--enable-torch-compile``: the decode step compiled by inductor on the CPU
(``engine/compiled_step.py``) gives the eager step's greedy tokens, for the default
model as it is served (its GGUF weights packed), while sequences join mid-way (batches
of one to five rows: one and two compiled, the rest eager) and a long prompt grows the
cache under it; neither the read length nor the grown cache compiles again.

inductor's fused RMSNorm and rotary sum in another order than aten's, so, as between
the eager step alone and in a busy batch, a near-tie may fall the other way on some
CPU: the tokens are compared while they agree, and where they part the two candidates
must have been close (the bound ``tests/e2e/test_e2e_quantization.py`` uses)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo

from sluice.engine.assembly import ModelScheduler, build_scheduler
from sluice.engine.compiled_step import use_cache_dir
from sluice.engine.gguf_packed import pack_model
from sluice.engine.kv_cache import write_kv
from sluice.engine.loader import load_causal_lm, load_tokenizer, resolve_model
from sluice.engine.scheduler import SchedulerConfig
from tests.conftest import DEFAULT_GGUF, missing_model
from tests.support.choice_events import Events
from tests.support.following import assert_runs_follow, serve_joining, steps_of


def test_the_kv_write_op_writes_in_place_when_compiled() -> None:
    """``sluice::write_kv`` inside a compiled function lands in the cache tensors
    themselves, in the layer it names, as the eager write does, with the cache's slots
    and capacity dynamic (as ``compiled_step`` marks them)."""
    keys, values = torch.zeros(3, 4, 2, 9, 4), torch.zeros(3, 4, 2, 9, 4)
    expected_k, expected_v = keys.clone(), values.clone()
    rows, positions = torch.tensor([[2], [0]]), torch.tensor([[5], [1]])
    key, value = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4)
    write_kv(expected_k, expected_v, 1, rows, positions, key, value)
    for cache in (keys, values):
        torch._dynamo.mark_dynamic(cache, 1)
        torch._dynamo.mark_dynamic(cache, 3)

    def write(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        torch.ops.sluice.write_kv(keys, values, 1, rows, positions, k, v)
        return keys[1, :, :, :6].sum()  # a read after the write sees it

    total = torch.compile(write, fullgraph=True)(key, value)
    assert torch.equal(keys, expected_k) and torch.equal(values, expected_v)
    assert torch.allclose(total, expected_k[1, :, :, :6].sum())


def test_inductor_keeps_its_kernels_beside_the_models_unless_told(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """torch's own default (under /tmp, which it writes into the environment when
    first asked) gives way to the models' cache; a folder the user named does not."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    use_cache_dir(tmp_path / "inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    use_cache_dir(tmp_path / "inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def _scheduler(model: Any, compiled: bool) -> ModelScheduler:
    config = SchedulerConfig(
        max_running=8,
        context_length=8192,
        initial_capacity=32,
        # Prompts that arrive while others decode join their step as a mixed one,
        # which binds a packed batch: the compiled step must not recompile after it.
        mixed_chunk=True,
        fixed_shape_decode=True,
        graph_max_batch=2,
        compile_decode=compiled,
    )
    return build_scheduler(model, config, eos_token_ids=frozenset({2}), device=torch.device("cpu"))


@pytest.mark.model
def test_compiled_decode_gives_the_eager_steps_tokens() -> None:
    if not DEFAULT_GGUF.exists():
        missing_model("default model missing: run `make model`")
    resolved = resolve_model(DEFAULT_GGUF)
    tok = load_tokenizer(resolved.folder)
    model = load_causal_lm(resolved.folder, dtype="float32", device="cpu")
    pack_model(model, resolved.folder, DEFAULT_GGUF)
    outputs = []
    for compiled in (False, True):
        torch._dynamo.utils.counters.clear()
        sch = _scheduler(model, compiled)
        events = Events()
        # On a thread of its own, as the server's engine steps: the compiled step's
        # guards were traced on this one, and must hold there too.
        with ThreadPoolExecutor(1) as engine_thread:
            engine_thread.submit(serve_joining, sch, tok, events).result()
        assert sch.cache.capacity > 32
        static = sch.runner.static
        assert static is not None and static.steps >= 8
        if compiled:
            # One compile per bucket (1 and 2 rows), at start-up: none for a longer
            # read, nor for the grown cache, nor after a mixed step.
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
        outputs.append({rid: steps_of(events, rid) for rid, _ in events.by_key})
    eager, compiled_steps = outputs
    assert_runs_follow(compiled_steps, eager)

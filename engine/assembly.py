"""Builds a scheduler over a loaded model: its KV cache, its runner (self-checked) and
the runner's fixed-shape decode, each sized from the scheduler's config.

This is where the engine's parts meet; the scheduler only sees a ``StepRunner`` and
the cache its slot table moves.
"""

from __future__ import annotations

from typing import Any

import structlog
import torch

from .attention import AttentionLayout
from .cuda_graphs import StaticDecode
from .direct_decode import DecodePath, DirectDecode, NotDirect, check
from .errors import UnsupportedModelError
from .fused_projections import quantization_of
from .grammar import TokenGrammar
from .kv_cache import SlotKVCache
from .model_runner import ModelRunner
from .platform import platform
from .scheduler import SchedulerConfig, StepScheduler

log = structlog.get_logger(__name__)

ModelScheduler = StepScheduler[ModelRunner]
"""A scheduler over a model (as opposed to a scripted runner in tests)."""

# Why an unquantised model keeps transformers' layers (``choose_decode_path``).
UNQUANTISED = "unquantised: transformers' layers keep the model's own generate's outputs"


def build_cache(
    model: Any, layout: AttentionLayout, config: SchedulerConfig, device: torch.device
) -> SlotKVCache:
    """The model's slot cache, each layer kind's layers in the storage that kind chose,
    with one slot (``size_cache`` sizes it; the slot table grows it as sequences
    arrive)."""
    dtype = next(model.parameters()).dtype
    capacity = min(config.initial_capacity, config.context_length)
    layers_of: dict[str, list[int]] = {}
    for layer, kind in enumerate(layout.layer_types):
        layers_of.setdefault(kind, []).append(layer)
    try:
        groups = [
            (layers, layout.kinds[kind].storage(
                model.config, len(layers), dtype=dtype, device=device, slots=1,
                capacity=capacity))
            for kind, layers in layers_of.items()
        ]  # fmt: skip
    except (AttributeError, TypeError, ZeroDivisionError) as exc:
        # RWKV, say: no attention layers, and no layer types saying so.
        raise UnsupportedModelError(
            f"{type(model).__name__}: its config gives no attention sizes for the cache "
            f"of its layers ({exc})"
        ) from exc
    return SlotKVCache(groups, dtype=dtype, device=device, slots=1, capacity=capacity)


def size_cache(cache: SlotKVCache, config: SchedulerConfig) -> None:
    """Start with a few slots, as many as the byte budget allows (at least one). Run
    after the self-check, by which a recurrent state's tensors exist (they take the
    shapes their layers first write)."""
    affordable = config.kv_cache_bytes // max(1, cache.bytes_for(1, cache.capacity))
    start = min(8, config.max_running + config.free_slots_kept, affordable)
    cache.resize(max(1, start), cache.capacity)


def build_runner(
    model: Any, cache: SlotKVCache, config: SchedulerConfig, device: torch.device
) -> ModelRunner:
    """The model's runner, checked against the model's own forward; raises
    ``UnsupportedModelError`` for a model it would serve wrong."""
    runner = ModelRunner(model, cache, context_length=config.context_length)
    runner.self_check()
    choose_decode_path(runner)
    if config.speculative is not None and not runner.packs:
        raise UnsupportedModelError(
            f"{type(model).__name__}: speculative decoding verifies drafts in packed "
            f"forwards, which models that {runner.why_unpacked} cannot run"
        )
    if config.fixed_shape_decode and cache.holds_state:
        # Its padding rows would advance the states of slots they do not own.
        log.info(
            "fixed_shape_decode_off",
            model=type(model).__name__,
            reason="a per-sequence recurrent state; decode steps run at their own shapes",
        )
    elif config.fixed_shape_decode:
        runner.static = StaticDecode(
            runner,
            max_batch=config.graph_max_batch or config.max_running,
            capture=platform(device.type).captures_graphs,
            compile=config.compile_decode,
        )
    return runner


def choose_decode_path(runner: ModelRunner) -> DecodePath:
    """Decode a quantised model's steps directly (``direct_decode``) where its layers
    are of a family it knows and it agrees with transformers' layers, and log which
    path serves and why. An unquantised model keeps transformers' layers, whose greedy
    outputs equal its own ``generate``'s bit for bit (its tests pin that); a quantised
    one differs from ``generate`` by its GEMMs' rounding already."""
    model = type(runner.model).__name__
    if quantization_of(runner.model) is None:
        runner.decode_path = DecodePath("transformers", UNQUANTISED)
        return runner.decode_path
    try:
        direct = DirectDecode.build(runner.model, runner.decoder, runner.cache, runner.layout)
        drift = check(runner, direct)
    except NotDirect as exc:
        runner.decode_path = DecodePath("transformers", f"not direct: {exc}")
    else:
        runner.direct = direct
        runner.decode_path = DecodePath(
            "direct", f"agrees with transformers' layers to {drift:.3g} nats"
        )
    log.info("decode_path", model=model, **runner.decode_path.to_dict())
    return runner.decode_path


def build_scheduler(
    model: Any,
    config: SchedulerConfig,
    *,
    eos_token_ids: frozenset[int],
    device: torch.device,
    grammar: TokenGrammar | None = None,
) -> ModelScheduler:
    cache = build_cache(model, AttentionLayout.for_model(model), config, device)
    runner = build_runner(model, cache, config, device)
    size_cache(cache, config)
    if runner.static is not None and config.compile_decode:
        runner.static.compile_buckets()  # before any request can wait for one
    return StepScheduler(
        runner,
        cache,
        config,
        eos_token_ids=eos_token_ids,
        grammar=grammar,
        vocab_size=int(model.config.vocab_size),
    )

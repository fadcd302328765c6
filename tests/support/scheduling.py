"""Tiny random models of many architectures (built from a transformers config), a
scheduler over one, and helpers that drive it and collect its events."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from sluice.engine.assembly import ModelScheduler, build_scheduler
from sluice.engine.attention import FULL, SLIDING
from sluice.engine.loader import load_causal_lm
from sluice.engine.params import SamplingParams, SequenceSpec
from sluice.engine.scheduler import SchedulerConfig
from sluice.events.types import EngineEvent, PromptProcessed, TokenSampled
from tests.support.greedy import greedy_run

S, F = SLIDING, FULL

WINDOW = 8


VOCAB = 512


NEW_TOKENS = 16


BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    # Wider than transformers' 0.02: sharper logits, so greedy outputs vary (a reference
    # that repeats one token would prove little) and have no near-ties.
    "initializer_range": 0.05,
}


# DeepSeek-style MLA at a tiny size; its rotary width is its head_dim, and its keys
# and values are every head's (num_key_value_heads is num_attention_heads).
_MLA = {
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "num_key_value_heads": 4,
}

# Mamba-2 mixers (Mamba 2, Bamba, Granite 4 hybrid, Nemotron-H) at a tiny size, with
# SSM chunks shorter than the prompts.
_MAMBA2 = {"n_groups": 1, "expand": 2, "chunk_size": 8}
# Gated delta-net layers (Qwen3-Next, Qwen3.5, OLMo hybrid) beside full attention.
_DELTA_NET = {
    "layer_types": ["linear_attention", F, "linear_attention", F],
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}
_MAMBA2_MIXER = {
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_expand": 2,
    "mamba_d_conv": 4,
    "mamba_chunk_size": 8,
}
_SHORT_CONV = {"layer_types": ["conv", F, "conv", F], "conv_L_cache": 3}

# model_type → (what it exercises, the config beyond BASE).
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("full attention", {}),
    "mistral": ("sliding window in every layer", {"sliding_window": WINDOW}),
    "qwen2": (
        "full layers below max_window_layers, sliding above",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2},
    ),
    "qwen3": (
        "q/k norms, hybrid window",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "qwen3_moe": (
        "MoE blocks, sliding window in every layer",
        {
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        },
    ),
    "gemma2": (
        "alternating local/global, attention and final logit soft-caps (eager attention)",
        {"sliding_window": WINDOW, "layer_types": [S, F, S, F]},
    ),
    "gemma3_text": (
        "5:1-style local/global, per-layer-type RoPE, final soft-cap",
        {"sliding_window": WINDOW, "layer_types": [S, S, F, S], "final_logit_softcapping": 5.0},
    ),
    "phi3": ("fused QKV and gate/up projections, sliding window", {"sliding_window": WINDOW}),
    "granite": (
        "embedding, residual, attention and logits multipliers",
        {
            "logits_scaling": 4.0,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.25,
        },
    ),
    "olmo2": ("post-norms, q/k norms", {}),
    "cohere2": (
        "3:1 local/global, global layers without RoPE, logit_scale",
        {"sliding_window": WINDOW, "layer_types": [S, S, S, F], "logit_scale": 0.5},
    ),
    "gpt_oss": (
        "attention sinks, MoE, alternating window (eager attention)",
        {
            "sliding_window": WINDOW,
            "layer_types": [S, F, S, F],
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "mixtral": (
        "MoE blocks, sliding window in every layer",
        {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "gpt_neox": (
        "fused QKV, parallel residual, partial rotary (Pythia)",
        {"rotary_pct": 0.5},
    ),
    "falcon": (
        "fused multi-query QKV, parallel attention/MLP, asks the cache its length",
        {"alibi": False, "initializer_range": 0.1},
    ),
    "deepseek_v3": (
        "MLA: a compressed latent cache (one head, kv_lora_rank + rotary key), MoE",
        {
            **_MLA,
            "q_lora_rank": 32,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    "deepseek_v2": (
        "MLA without a query LoRA, MoE",
        {
            **_MLA,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
        },
    ),
    "minicpm3": ("MLA, scaled embeddings and residuals", {**_MLA, "q_lora_rank": 32}),
    "llama4_text": (
        "chunked attention in the RoPE layers, NoPE full layers, MoE",
        {
            "attention_chunk_size": WINDOW,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "intermediate_size_mlp": 128,
            "interleave_moe_layer_step": 2,
        },
    ),
    "phi": ("partial rotary, parallel attention/MLP, layer norms", {}),
    "stablelm": ("partial rotary, QKV biases, layer norms", {}),
    "gemma": ("scaled embeddings, GeGLU", {}),
    "cohere": ("parallel attention/MLP, logit_scale", {"logit_scale": 0.5}),
    "olmoe": ("MoE, q/k norms", {"num_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "MoE with a shared expert",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
        },
    ),
    "glm4": ("post-norms, partial interleaved rotary", {}),
    "smollm3": ("NoPE every fourth layer", {}),
    "nemotron": ("squared-ReLU MLP, layernorm1p, partial rotary", {}),
    "granitemoe": (
        "MoE with Granite's multipliers",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "logits_scaling": 4.0},
    ),
    "mpt": ("ALiBi position biases, fused QKV", {}),
    "gpt2": ("Conv1D projections, a learned position table", {"initializer_range": 0.1}),
    "biogpt": (
        "a learned position table, scaled embeddings, asks the cache its length",
        {"initializer_range": 0.1},
    ),
    "exaone4": (
        "3:1 local/global with NoPE global layers, post-norms",
        {"sliding_window": WINDOW, "sliding_window_pattern": 4},
    ),
    "mamba2": (
        "Mamba-2 state-space layers only: conv and SSM state per sequence",
        {**_MAMBA2, "num_heads": 8, "head_dim": 16, "state_size": 16, "conv_kernel": 4},
    ),
    "bamba": (
        "Mamba-2 layers beside full attention",
        {**_MAMBA2_MIXER, "attn_layer_indices": [1, 3]},
    ),
    "granitemoehybrid": (
        "Granite 4 hybrid: Mamba-2 layers, attention, MoE with a shared expert",
        {
            **_MAMBA2_MIXER,
            "layer_types": ["linear_attention", F, "linear_attention", F],
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 64,
        },
    ),
    "nemotron_h": (
        "Nemotron-H: Mamba-2, attention and MLP blocks as layers of their own",
        {
            **_MAMBA2,
            "hybrid_override_pattern": "M*M-",
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "ssm_state_size": 16,
            "conv_kernel": 4,
        },
    ),
    "qwen3_next": (
        "gated delta-net linear attention beside gated full attention, MoE",
        {
            **_DELTA_NET,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "decoder_sparse_step": 1,
        },
    ),
    "qwen3_5_text": ("gated delta-net linear attention beside full attention", _DELTA_NET),
    "olmo_hybrid": ("gated delta-net layers beside full attention, post-norms", _DELTA_NET),
    "lfm2": ("LFM2: gated short convolutions (a conv state) beside attention", _SHORT_CONV),
    "lfm2_moe": (
        "LFM2 short convolutions, attention, MoE after a dense layer",
        {
            **_SHORT_CONV,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "num_dense_layers": 1,
        },
    ),
}

# Models whose layers carry a per-sequence recurrent state (``recurrent_state``): no
# packed steps, no prefix reuse, no fixed-shape step.
RECURRENT = frozenset(
    {
        "mamba2",
        "bamba",
        "granitemoehybrid",
        "nemotron_h",
        "qwen3_next",
        "qwen3_5_text",
        "olmo_hybrid",
        "lfm2",
        "lfm2_moe",
    }
)


# Models whose attention calls SDPA itself rather than through transformers' attention
# interface, and recurrent models: served in unpacked forwards (no mixed steps, no
# speculative decoding).
UNPACKED = frozenset({"falcon", "mpt"}) | RECURRENT


def config_kwargs(model_type: str, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """BASE's sizes that ``model_type``'s config has (a config given a setting it does not
    know keeps it as an attribute its model never reads, such as GPT-NeoX given
    ``num_key_value_heads``), then the architecture's own settings (``settings``, for
    one outside the matrix)."""
    default = AutoConfig.for_model(model_type)
    known = {
        key: value
        for key, value in BASE.items()
        if hasattr(default, key) and not isinstance(getattr(type(default), key, None), property)
    }
    return known | (ARCHITECTURES[model_type][1] if settings is None else settings)


def build(model_type: str, folder: Path, settings: dict[str, Any] | None = None) -> Any:
    """A random model of ``model_type``, saved to ``folder`` and loaded back the way the
    server loads a transformers folder (SDPA, or eager where SDPA is refused)."""
    config = AutoConfig.for_model(model_type, **config_kwargs(model_type, settings))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, attn_implementation="eager").save_pretrained(folder)
    model = load_causal_lm(folder, dtype="float32", device="cpu")
    model.generation_config.eos_token_id = None
    return model


def prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


def generate(model: Any, ids: list[int], n: int = NEW_TOKENS) -> tuple[list[int], list[float]]:
    """``model.generate``'s greedy tokens and their log-probabilities."""
    run = greedy_run(model, ids, n)
    return run.tokens, run.logprobs()


class Events:
    def __init__(self) -> None:
        self.by_rid: dict[str, list[EngineEvent]] = defaultdict(list)

    def __call__(self, sink: Any, event: EngineEvent) -> None:
        self.by_rid[event.request_id].append(event)

    def tokens(self, rid: str) -> list[int]:
        return [e.token_id for e in self.by_rid[rid] if isinstance(e, TokenSampled)]

    def logprobs(self, rid: str) -> list[float]:
        return [
            e.logprob.logprob
            for e in self.by_rid[rid]
            if isinstance(e, TokenSampled) and e.logprob is not None
        ]

    def cached(self, rid: str) -> int:
        first = self.by_rid[rid][0]
        assert isinstance(first, PromptProcessed)
        return first.cached_tokens


def scheduler(model: Any, **kw: Any) -> ModelScheduler:
    config = SchedulerConfig(max_running=8, context_length=256, prefill_chunk=7, **kw)
    return build_scheduler(model, config, eos_token_ids=frozenset(), device=torch.device("cpu"))


def add(sch: ModelScheduler, events: Events, rid: str, ids: list[int], **params: Any) -> None:
    params.setdefault("max_tokens", NEW_TOKENS)
    sampling = SamplingParams(temperature=0.0, **params)
    sch.add(SequenceSpec(rid, 0, tuple(ids), sampling), events)


def drain(sch: ModelScheduler, events: Events) -> None:
    while sch.has_work:
        sch.step(events)

"""A decode step that runs the decoder's layers directly: nine calls a layer.

transformers' decoder layers spend most of a one-row CPU step outside arithmetic: on
SmolLM2 at one row, ≈1 800 small ops and the Python of 30 layers' modules take more
time than the packed GEMMs (docs/benchmarks.md). For the layer families whose
structure is known here, a decode step (one token a row, rows in slots ``0..B``) runs
instead as, per layer:

    h = rms_norm_residual(x, delta)      residual add ending the last block, next norm
    qkv = the fused q/k/v GEMM
    q = rope_kv(qkv)                     q/k norms, rotary, key and value into the cache
    o = decode_attention(q)              causal (sliding where the layer is), grouped heads
    h = rms_norm_residual(x, o_proj(o))  (Gemma 3 normalises the delta first)
    gate_up = the fused gate/up GEMM
    delta = down_proj(gated_act(gate_up))

the small steps being Sluice's own ops (``engine/kernels/decode_ops.cpp``) and the
GEMMs the model's own projections (``fused_projections``). The embedding and the LM
head are the model's modules.

Served this way: Llama (SmolLM2), Mistral, Qwen 2, Qwen 3 and Gemma 3 decoder layers
with default, linear or Llama-3 rotary scaling, attention full or sliding. Anything
else, and prompt chunks, mixed and speculative steps, run through transformers'
layers. ``DirectDecode.build`` says why a model is not served this way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .attention import AttentionLayout
from .fused_projections import ProjectionMember, SharedProjections
from .kv_cache import DenseKV, SlotKVCache
from .layer_kinds import FullAttention, SlidingAttention
from .native_kernels import planes_kernel

if TYPE_CHECKING:
    from .model_runner import ModelRunner

# Decoder layers whose forward is the one above (Gemma 3's with its sandwich norms).
LAYERS = frozenset(
    {
        "LlamaDecoderLayer",
        "MistralDecoderLayer",
        "Qwen2DecoderLayer",
        "Qwen3DecoderLayer",
        "Gemma3DecoderLayer",
    }
)
# RMSNorms that multiply by their weight, and those that multiply by 1 + weight.
PLAIN_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
OFFSET_NORMS = frozenset({"Gemma3RMSNorm"})
# Rotary embeddings whose inverse frequencies are fixed once made (a dynamic one
# changes them with the sequence's length).
STATIC_ROPE = frozenset({"default", "linear", "llama3"})
# ``gated_act``'s activations, by transformers' config names.
ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}

# How far the direct step may stray from transformers' layers over the likeliest
# ``TOP`` tokens of a probe (``check``). The direct step serves quantised models, whose
# int8 activations turn a last-bit difference of a summing order into another code:
# the packed SmolLM2 and Gemma 3 in bf16 stray by ≈0.2–0.5 nats; with every layer's
# attention scores scaled ×4, SmolLM2 strays past it (``tests/engine``).
TOLERANCE = 1.0
TOP = 20
PROBE_LENGTHS = (16, 5)  # two rows at different positions

Product = Callable[[torch.Tensor], torch.Tensor]


class NotDirect(Exception):
    """Why a model's decode step cannot run directly."""


@dataclass(frozen=True)
class Norm:
    weight: torch.Tensor  # float32: the weight the output is multiplied by
    eps: float


@dataclass(frozen=True)
class Rotary:
    inv_freq: torch.Tensor  # float32 [head_dim / 2]
    scale: float  # transformers' ``attention_scaling``


@dataclass(frozen=True)
class Layer:
    """One decoder layer's weights and settings, as the step reads them."""

    storage: DenseKV
    cache_layer: int  # the layer's index in its storage
    attention_norm: Norm
    qkv: Product
    q_norm: Norm | None
    k_norm: Norm | None
    rotary: Rotary
    window: int  # 0: full attention
    scale: float
    softcap: float  # 0: none
    o_proj: Product
    post_attention_norm: Norm | None  # applied to the attention's output (Gemma 3)
    mlp_norm: Norm
    gate_up: Product
    activation: int
    down: Product
    post_mlp_norm: Norm | None  # applied to the MLP's output (Gemma 3)


class DirectDecode:
    """The decode step above over ``cache`` (built by ``build``)."""

    def __init__(
        self,
        embed: nn.Module,
        layers: Sequence[Layer],
        final_norm: Norm,
        *,
        heads: int,
        kv_heads: int,
        dtype: torch.dtype,
    ) -> None:
        self.embed = embed
        self.layers = list(layers)
        self.final_norm = final_norm
        self.heads = heads
        self.kv_heads = kv_heads
        self.dtype = dtype

    @classmethod
    def build(
        cls, model: Any, decoder: Any, cache: SlotKVCache, layout: AttentionLayout
    ) -> DirectDecode:
        """The direct step for ``model``; raises ``NotDirect`` saying why not."""
        if cache.device.type != "cpu":
            raise NotDirect("its ops are CPU ones")
        unavailable = planes_kernel()  # the library that holds the ops
        if unavailable is not None:
            raise NotDirect(f"Sluice's kernels are not built here ({unavailable})")
        config = model.config
        names = {type(layer).__name__ for layer in decoder.layers}
        if not names <= LAYERS:
            raise NotDirect(f"its layers are {', '.join(sorted(names - LAYERS))}")
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "")
        if activation not in ACTIVATIONS:
            raise NotDirect(f"its activation is {activation!r}")
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        rotaries = _rotaries(decoder.rotary_emb, layout)
        layers = [
            _layer(i, layer, cache, layout, rotaries, ACTIVATIONS[activation])
            for i, layer in enumerate(decoder.layers)
        ]
        return cls(
            decoder.embed_tokens,
            layers,
            _norm(decoder.norm),
            heads=heads,
            kv_heads=kv_heads,
            dtype=cache.dtype,
        )

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The last hidden states ``[rows, H]`` of row ``r`` (slot ``r``) taking token
        ``ids[r]`` at ``positions[r]`` (both int64 ``[rows]``); the cache must hold
        positions up to the largest."""
        ops = torch.ops.sluice_kernels
        x = self.embed(ids).to(self.dtype).contiguous()
        delta: torch.Tensor | None = None
        delta_norm: Norm | None = None
        for layer in self.layers:
            norm = layer.attention_norm
            h = ops.rms_norm_residual(x, delta, _weight(delta_norm), norm.weight, norm.eps)
            q = ops.rope_kv(
                layer.qkv(h),
                positions,
                layer.rotary.inv_freq,
                layer.rotary.scale,
                _weight(layer.q_norm),
                _weight(layer.k_norm),
                (layer.q_norm or norm).eps,
                layer.storage.k,
                layer.storage.v,
                layer.cache_layer,
                self.heads,
                self.kv_heads,
            )
            attended = ops.decode_attention(
                q,
                layer.storage.k,
                layer.storage.v,
                layer.cache_layer,
                positions,
                layer.window,
                layer.scale,
                layer.softcap,
            )
            norm = layer.mlp_norm
            h = ops.rms_norm_residual(
                x,
                layer.o_proj(attended),
                _weight(layer.post_attention_norm),
                norm.weight,
                norm.eps,
            )
            delta = layer.down(ops.gated_act(layer.gate_up(h), layer.activation, self.dtype))
            delta_norm = layer.post_mlp_norm
        norm = self.final_norm
        out: torch.Tensor = ops.rms_norm_residual(
            x, delta, _weight(delta_norm), norm.weight, norm.eps
        )
        return out


def _weight(norm: Norm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


def _norm(module: Any) -> Norm:
    name = type(module).__name__
    weight = module.weight.detach().float()
    if name in OFFSET_NORMS:
        weight = 1.0 + weight
    elif name not in PLAIN_NORMS:
        raise NotDirect(f"it normalises with {name}")
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = module.eps
    return Norm(weight.contiguous(), float(eps))


def _rotaries(rotary: Any, layout: AttentionLayout) -> dict[str, Rotary]:
    """Each layer type's rotary frequencies: one set for the model, or one a layer type
    (Gemma 3's local and global layers)."""
    found: dict[str, Rotary] = {}
    for kind in dict.fromkeys(layout.layer_types):
        inv_freq = getattr(rotary, f"{kind}_inv_freq", None)
        if inv_freq is None:
            inv_freq = getattr(rotary, "inv_freq", None)
            scale = getattr(rotary, "attention_scaling", 1.0)
            rope_type = getattr(rotary, "rope_type", "default")
        else:
            scale = getattr(rotary, f"{kind}_attention_scaling", 1.0)
            rope_type = getattr(rotary, "rope_type", {}).get(kind, "default")
        if inv_freq is None:
            raise NotDirect("its rotary embedding has no inverse frequencies")
        if rope_type not in STATIC_ROPE:
            raise NotDirect(f"its rotary scaling is {rope_type!r}")
        found[kind] = Rotary(inv_freq.detach().float().contiguous(), float(scale))
    return found


def _layer(
    index: int,
    layer: Any,
    cache: SlotKVCache,
    layout: AttentionLayout,
    rotaries: dict[str, Rotary],
    activation: int,
) -> Layer:
    attention, mlp = layer.self_attn, layer.mlp
    kind = layout.kinds[layout.layer_types[index]]
    if isinstance(kind, SlidingAttention):
        window = kind.window
    elif isinstance(kind, FullAttention):
        window = 0
    else:
        raise NotDirect(f"layer {index} is {type(kind).__name__}")
    storage, cache_layer = cache.layer_storage(index)
    if not isinstance(storage, DenseKV) or storage.value_dim != storage.head_dim:
        raise NotDirect(f"layer {index}'s cache is {type(storage).__name__}")
    if storage.head_dim % 2:
        raise NotDirect("its heads are an odd width")
    rotary = rotaries[layout.layer_types[index]]
    if rotary.inv_freq.numel() * 2 != storage.head_dim:
        raise NotDirect("its rotary embedding covers part of each head")
    sandwich = hasattr(layer, "pre_feedforward_layernorm")
    softcap = getattr(attention.config, "attn_logit_softcapping", None) or 0.0
    return Layer(
        storage=storage,
        cache_layer=cache_layer,
        attention_norm=_norm(layer.input_layernorm),
        qkv=_product(attention, ("q_proj", "k_proj", "v_proj")),
        q_norm=_norm(attention.q_norm) if hasattr(attention, "q_norm") else None,
        k_norm=_norm(attention.k_norm) if hasattr(attention, "k_norm") else None,
        rotary=rotary,
        window=window,
        scale=float(attention.scaling),
        softcap=float(softcap),
        o_proj=_product(attention, ("o_proj",)),
        post_attention_norm=_norm(layer.post_attention_layernorm) if sandwich else None,
        mlp_norm=_norm(
            layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
        ),
        gate_up=_product(mlp, ("gate_proj", "up_proj")),
        activation=activation,
        down=_product(mlp, ("down_proj",)),
        post_mlp_norm=_norm(layer.post_feedforward_layernorm) if sandwich else None,
    )


def _product(parent: Any, names: tuple[str, ...]) -> Product:
    """One GEMM giving ``names``' outputs side by side: their shared projection where
    Sluice fused them (a quantised model), else their ``nn.Linear``s one after another."""
    members = [getattr(parent, name) for name in names]
    if all(isinstance(m, ProjectionMember) for m in members):
        shared: SharedProjections = members[0].shared
        if all(m.shared is shared for m in members) and [m.member for m in members] == list(
            range(len(shared.bounds))
        ):
            return shared.product
    if all(type(m) is nn.Linear for m in members):
        if len(members) == 1:
            linear = members[0]
            return lambda rows: nn.functional.linear(rows, linear.weight, linear.bias)
        return lambda rows: torch.cat(
            [nn.functional.linear(rows, m.weight, m.bias) for m in members], dim=-1
        )
    raise NotDirect(f"its {'/'.join(names)} are {type(members[0]).__name__}s, not fused as one")


@torch.inference_mode()
def check(runner: ModelRunner, direct: DirectDecode, tolerance: float = TOLERANCE) -> float:
    """How far a decode step of two rows at different positions strays through
    ``direct`` from the same step through transformers' layers, over the likeliest
    tokens' log-probabilities; raises ``NotDirect`` past ``tolerance``."""
    cache = runner.cache
    vocab = int(runner.model.config.vocab_size)
    lengths = [min(n, cache.capacity - 1, runner.context_length - 1) for n in PROBE_LENGTHS]
    sequences = [[(t * 7919 + 13 * r) % max(vocab - 1, 1) + 1 for t in range(n + 1)]
                 for r, n in enumerate(lengths)]  # fmt: skip
    slots = cache.slots
    if slots < 2:
        cache.resize(2, cache.capacity)
    device = cache.device
    try:
        for r, (seq, n) in enumerate(zip(sequences, lengths, strict=True)):
            runner.forward(slice(r, r + 1), torch.tensor([seq[:n]], device=device),
                           torch.arange(n, device=device).unsqueeze(0))  # fmt: skip
        last = [seq[n] for seq, n in zip(sequences, lengths, strict=True)]
        ids = torch.tensor(last, device=device)
        positions = torch.tensor(lengths, dtype=torch.long, device=device)
        layers = runner.forward(slice(0, 2), ids.unsqueeze(1), positions.unsqueeze(1))[:, -1]
        expected = runner.head(layers).float()
        got = runner.head(direct.hidden(ids, positions)).float()
    finally:
        if slots < 2:
            cache.resize(slots, cache.capacity)
    top = expected.topk(min(TOP, expected.shape[-1]), dim=-1).indices
    want = expected.log_softmax(-1).gather(-1, top)
    drift = float((got.log_softmax(-1).gather(-1, top) - want).abs().max())
    if not drift <= tolerance:
        raise NotDirect(
            f"its direct step's log-probabilities of the likeliest tokens differ from "
            f"transformers' layers' by up to {drift:.3g}"
        )
    return drift

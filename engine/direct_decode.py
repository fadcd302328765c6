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
GEMMs the model's own projections (``fused_projections``), each described to C++ as a
``Gemm`` over the same weights. The whole loop runs in one call
(``engine/kernels/decode_stack.cpp``): from Python, a SmolLM2 step was 270 op calls
at ≈3.5 µs of dispatch each, and the Python between them. The embedding and the LM
head are the model's modules.

Served this way: Llama (SmolLM2), Mistral, Qwen 2, Qwen 3 and Gemma 3 decoder layers
with default, linear or Llama-3 rotary scaling, attention full or sliding. A packed
step (decode rows with their drafts, prompt chunks) and a prompt-only step run this way
too, a token a row with its own slot, where each group is short enough for the
per-token attention (``packed.takes_own``); a longer chunk's step takes transformers'
layers, its decode rows still this attention. Anything else runs through transformers'
layers. ``DirectDecode.build`` says why a model is not served this way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .attention import AttentionLayout
from .fused_projections import ProjectionMember, SharedProjections
from .gguf_packed import Int4Projections
from .int8_projections import Int8Projections
from .kv_cache import DenseKV, SlotKVCache
from .layer_kinds import FullAttention, SlidingAttention
from .native_kernels import planes_kernel
from .packed import OwnAttention
from .plane_kernels import OwnPlanes, TorchPlanes

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

# ``torch.classes.sluice_kernels.Gemm``: one projection as the C++ step multiplies it.
Gemm = Any
# Its kinds (``decode_stack.cpp``).
OWN_PLANES, TORCH_PLANES, DENSE, INT8_ROWS, OWN_FIVES = range(5)


class NotDirect(Exception):
    """Why a model's decode step cannot run directly."""


@dataclass(frozen=True)
class DecodePath:
    """Which layers a model's decode steps run through, ``direct`` or ``transformers``,
    and why: the start-up log's ``decode_path`` line and ``/server_info``'s."""

    path: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "reason": self.reason}


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
    qkv: Gemm
    q_norm: Norm | None
    k_norm: Norm | None
    rotary: Rotary
    window: int  # 0: full attention
    scale: float
    softcap: float  # 0: none
    o_proj: Gemm
    post_attention_norm: Norm | None  # applied to the attention's output (Gemma 3)
    mlp_norm: Norm
    gate_up: Gemm
    activation: int
    down: Gemm
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
        self.layers = tuple(layers)
        self.final_norm = final_norm
        self.heads = heads
        self.kv_heads = kv_heads
        self.dtype = dtype
        # The caches' storages, each once; a layer names its own by index.
        self.storages = list({id(layer.storage): layer.storage for layer in self.layers}.values())
        # Each layer's attention as a packed step's tokens can take it too (``packed``).
        self.attention = tuple(
            OwnAttention(layer.window, layer.scale, layer.softcap) for layer in self.layers
        )
        self._stack = torch.classes.sluice_kernels.DecodeStack(
            heads, kv_heads, final_norm.weight, final_norm.eps
        )
        for layer in self.layers:
            self._add(layer)

    def _add(self, layer: Layer) -> None:
        storage = next(i for i, s in enumerate(self.storages) if s is layer.storage)
        self._stack.add_layer(
            storage,
            layer.cache_layer,
            layer.attention_norm.weight,
            layer.attention_norm.eps,
            layer.qkv,
            _weight(layer.q_norm),
            _weight(layer.k_norm),
            (layer.q_norm or layer.attention_norm).eps,
            layer.rotary.inv_freq,
            layer.rotary.scale,
            layer.window,
            layer.scale,
            layer.softcap,
            layer.o_proj,
            _weight(layer.post_attention_norm),
            _eps(layer.post_attention_norm),
            layer.mlp_norm.weight,
            layer.mlp_norm.eps,
            layer.gate_up,
            layer.activation,
            layer.down,
            _weight(layer.post_mlp_norm),
            _eps(layer.post_mlp_norm),
        )

    def with_layers(self, layers: Sequence[Layer]) -> DirectDecode:
        """The same step over ``layers`` instead (a test's altered layer)."""
        return DirectDecode(self.embed, layers, self.final_norm, heads=self.heads,
                            kv_heads=self.kv_heads, dtype=self.dtype)  # fmt: skip

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

    def hidden(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The last hidden states ``[rows, H]`` of row ``r`` (slot ``r``, or ``slots[r]``)
        taking token ``ids[r]`` at ``positions[r]`` (all int64 ``[rows]``); the cache must
        hold positions up to the largest. With ``slots``, rows may share a slot (a packed
        step's prompt chunk, a token a row): each writes its key and value at its
        position, then attends up to it."""
        x = self.embed(ids).to(self.dtype).contiguous()
        keys = [storage.k for storage in self.storages]
        values = [storage.v for storage in self.storages]
        out: torch.Tensor = self._stack.forward(x, positions, keys, values, slots)
        return out


def _weight(norm: Norm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


def _eps(norm: Norm | None) -> float:
    return 0.0 if norm is None else norm.eps


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
        qkv=_gemm(attention, ("q_proj", "k_proj", "v_proj")),
        q_norm=_norm(attention.q_norm) if hasattr(attention, "q_norm") else None,
        k_norm=_norm(attention.k_norm) if hasattr(attention, "k_norm") else None,
        rotary=rotary,
        window=window,
        scale=float(attention.scaling),
        softcap=float(softcap),
        o_proj=_gemm(attention, ("o_proj",)),
        post_attention_norm=_norm(layer.post_attention_layernorm) if sandwich else None,
        mlp_norm=_norm(
            layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
        ),
        gate_up=_gemm(mlp, ("gate_proj", "up_proj")),
        activation=activation,
        down=_gemm(mlp, ("down_proj",)),
        post_mlp_norm=_norm(layer.post_feedforward_layernorm) if sandwich else None,
    )


def _gemm(parent: Any, names: tuple[str, ...]) -> Gemm:
    """One GEMM giving ``names``' outputs side by side: their shared projection where
    Sluice fused them (a quantised model), else their ``nn.Linear``s' weights joined."""
    members = [getattr(parent, name) for name in names]
    if all(isinstance(m, ProjectionMember) for m in members):
        shared: SharedProjections = members[0].shared
        if all(m.shared is shared for m in members) and [m.member for m in members] == list(
            range(len(shared.bounds))
        ):
            return _shared_gemm(shared)
    if all(type(m) is nn.Linear for m in members):
        weight = torch.cat([m.weight.detach() for m in members])
        biases = [m.bias for m in members]
        bias = None if all(b is None for b in biases) else torch.cat([
            torch.zeros(m.out_features, dtype=m.weight.dtype) if m.bias is None else m.bias.detach()
            for m in members
        ])  # fmt: skip
        return torch.classes.sluice_kernels.Gemm(DENSE, [weight], bias, -1, None)
    raise NotDirect(f"its {'/'.join(names)} are {type(members[0]).__name__}s, not fused as one")


def _shared_gemm(shared: SharedProjections) -> Gemm:
    """``shared``'s own multiply (``SharedProjections.product``) over its weights."""
    make = torch.classes.sluice_kernels.Gemm
    if isinstance(shared, Int8Projections):
        return make(INT8_ROWS, [shared.weight, shared.scale], shared.bias, -1, None)
    if isinstance(shared, Int4Projections):
        kernel = shared.kernel
        if isinstance(kernel, OwnPlanes):
            held = [kernel.codes, kernel.scales, kernel.offset]  # centred: no offset
            kind = OWN_FIVES if kernel.five_bit else OWN_PLANES
            weights = [t for t in held if t is not None]
        elif isinstance(kernel, TorchPlanes):
            kind, weights = TORCH_PLANES, [t for plane in kernel.planes for t in plane]
        else:
            raise NotDirect(f"its packed kernel is {type(kernel).__name__}")
        return make(kind, weights, shared.bias, int(shared.max_rows), shared.dense)
    raise NotDirect(f"its projections are {type(shared).__name__}")


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

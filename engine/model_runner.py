"""Executes forwards over the slot cache: the decoder, each layer's mask, the LM head.

The scheduler decides which rows run and at which positions; the runner turns that
into one decoder call and the logits of the rows asked for. It calls the decoder and
the LM head separately (a prefill chunk needs logits at one position per row, not
the whole vocabulary at every position), so the logit post-processing that the
model's ``…ForCausalLM.forward`` applies after its LM head is applied here too:
Gemma's final soft-cap, Granite's ``logits_scaling``, Cohere's ``logit_scale``.

Before serving, ``self_check`` runs a short probe through this path and through the
model's own forward: a model whose logits this path does not reproduce (a layer kind,
a cache call or a post-processing step not handled here) is refused at start-up with
its architecture named, instead of being served wrong tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from .attention import AttentionLayout, UnsupportedModelError
from .kv_cache import SlotKVCache

_PROBE_TOKENS = 16
# How far the probe's log-probabilities may stray from the model's own forward: two
# different SDPA kernels agree to ~1e-5 in fp32 and to a few hundredths in 16 bits.
_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.1}


class LogitsHead:
    """The LM head and the post-processing of its output, as the model's forward does it."""

    def __init__(self, model: Any) -> None:
        config = model.config
        self.lm_head = model.get_output_embeddings()
        self.multiply = getattr(config, "logit_scale", None)
        self.divide = getattr(config, "logits_scaling", None)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(hidden)
        if self.multiply is not None:
            logits = logits * self.multiply
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class ModelRunner:
    def __init__(self, model: Any, cache: SlotKVCache, *, context_length: int) -> None:
        self.model = model
        self.decoder = model.get_decoder()
        self.head = LogitsHead(model)
        self.cache = cache
        self.layout = AttentionLayout.for_model(model)
        self.context_length = context_length

    def forward(
        self, rows: slice | torch.Tensor, ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Run the decoder; row ``r`` holds ``ids[r]`` at ``positions[r]`` of its slot.
        Returns the last hidden states ``[rows, T, H]``."""
        needed = int(positions.max().item()) + 1
        cache = self.cache
        if needed > cache.capacity:
            cache.resize(cache.slots, min(max(needed, cache.capacity * 2), self.context_length))
        read_len = cache.bind(rows, positions)
        return self.decode(ids, positions, self.layout.masks(positions, read_len))

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, mask: Any) -> torch.Tensor:
        """The decoder over a cache already bound for this forward."""
        out = self.decoder(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
        )
        hidden: torch.Tensor = out.last_hidden_state
        return hidden

    @torch.inference_mode()
    def self_check(self) -> None:
        """Compare a probe's logits on this path with the model's own forward; raises
        ``UnsupportedModelError`` where they differ (or this path fails)."""
        architecture = type(self.model).__name__
        length = min(_PROBE_TOKENS, self.cache.capacity, self.context_length)
        vocab = int(self.model.config.vocab_size)
        device = self.cache.device
        ids = (torch.arange(length, device=device) * 7919 % max(vocab - 1, 1) + 1).unsqueeze(0)
        expected = self.model(input_ids=ids, use_cache=False).logits[0].float()
        try:
            hidden = self.forward(slice(0, 1), ids, torch.arange(length, device=device)[None])
        except (RuntimeError, TypeError, AttributeError, KeyError, ValueError) as exc:
            raise UnsupportedModelError(
                f"{architecture} cannot run over Sluice's slot KV cache: {exc}"
            ) from exc
        got = self.head(hidden[0]).float()
        drift = (got.log_softmax(-1) - expected.log_softmax(-1)).abs().max().item()
        if not drift <= _TOLERANCE.get(self.cache.dtype, 0.25):
            raise UnsupportedModelError(
                f"{architecture}: Sluice's forward does not reproduce the model's own logits "
                f"(log-probabilities differ by up to {drift:.3g})"
            )

"""The architecture matrix: tiny random models that transformers builds from a config,
served by the step scheduler, token for token equal to ``model.generate``.

Every sliding window (8 positions) is far shorter than the prompts (30–45 tokens), and
prefill runs in 7-token chunks, so a layer masked as full attention, a chunk that
misses its window, or a cached prefix reused across a window changes the tokens. The
logits post-processing (soft-caps, scales) is checked through the logprobs. Each
model builds in well under a second; nothing is downloaded.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from sluice.engine.attention import (
    FULL,
    PACKED,
    PACKED_EAGER,
    PACKED_WRAPS,
    SLIDING,
    AttentionLayout,
    UnsupportedModelError,
)
from sluice.engine.loader import load_causal_lm
from sluice.engine.params import SamplingParams, SequenceSpec
from sluice.engine.scheduler import SchedulerConfig, StepScheduler
from sluice.events.types import EngineEvent, PromptProcessed, TokenSampled

WINDOW = 8
VOCAB = 512
NEW_TOKENS = 16

_BASE = {
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
S, F = SLIDING, FULL

# model_type → (what it exercises, the config beyond _BASE).
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
}


def build(model_type: str, folder: Path) -> Any:
    """A random model of ``model_type``, saved to ``folder`` and loaded back the way the
    server loads a transformers folder (SDPA, or eager where SDPA is refused)."""
    config = AutoConfig.for_model(model_type, **{**_BASE, **ARCHITECTURES[model_type][1]})
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
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(ids) :].tolist()
    steps = zip(out.logits, tokens, strict=True)
    logprobs = [float(step[0].float().log_softmax(-1)[t]) for step, t in steps]
    return tokens, logprobs


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


def scheduler(model: Any, **kw: Any) -> StepScheduler:
    config = SchedulerConfig(max_running=8, context_length=256, prefill_chunk=7, **kw)
    return StepScheduler(model, config, eos_token_ids=frozenset(), device=torch.device("cpu"))


def add(sch: StepScheduler, events: Events, rid: str, ids: list[int], **params: Any) -> None:
    params.setdefault("max_tokens", NEW_TOKENS)
    sampling = SamplingParams(temperature=0.0, **params)
    sch.add(SequenceSpec(rid, 0, tuple(ids), sampling), events)


def drain(sch: StepScheduler, events: Events) -> None:
    while sch.has_work:
        sch.step(events)


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Any]:
    name: str = request.param
    return name, build(name, tmp_path_factory.mktemp(name))


def test_the_matrix_slides_where_transformers_does(arch: tuple[str, Any]) -> None:
    """The layout read from each config: which layers slide, and the mask format."""
    name, model = arch
    layout = AttentionLayout.for_model(model)
    declared = ARCHITECTURES[name][1]
    if "layer_types" in declared:
        assert list(layout.layer_types) == declared["layer_types"]
    slides = "sliding_window" in declared
    assert (SLIDING in layout.layer_types) == slides
    assert layout.sliding_window == (WINDOW if slides else None)
    implementation = model.config._attn_implementation  # packed once a scheduler ran
    eager = PACKED_WRAPS.get(implementation, implementation) == "eager"
    assert (layout.additive_dtype is not None) == eager
    assert eager == (name in ("gemma2", "gpt_oss"))


def test_alone_equals_generate(arch: tuple[str, Any]) -> None:
    """A prompt four windows long, prefilled in chunks, with logprobs."""
    _, model = arch
    ids = prompt(9, 33)
    expected, expected_lps = generate(model, ids)
    assert len(set(expected)) >= 3, "a degenerate reference would prove little"
    sch, events = scheduler(model), Events()
    add(sch, events, "alone", ids, logprobs=0)
    drain(sch, events)
    assert events.tokens("alone") == expected
    assert events.logprobs("alone") == pytest.approx(expected_lps, abs=1e-4)


def test_inside_a_busy_batch_equals_generate(arch: tuple[str, Any]) -> None:
    """Sequences of other lengths join while the others prefill and decode."""
    _, model = arch
    prompts = {"a": prompt(2, 45), "b": prompt(3, 5), "c": prompt(4, 19), "d": prompt(5, 31)}
    sch, events = scheduler(model), Events()
    add(sch, events, "a", prompts["a"])
    add(sch, events, "b", prompts["b"])
    for _ in range(3):
        sch.step(events)
    add(sch, events, "c", prompts["c"])
    sch.step(events)
    add(sch, events, "d", prompts["d"])
    drain(sch, events)
    for rid, ids in prompts.items():
        assert events.tokens(rid) == generate(model, ids)[0], rid


def test_mixed_steps_equal_generate(arch: tuple[str, Any]) -> None:
    """Prompt chunks packed into one forward with the decode rows (over SDPA, or over
    the model's own eager attention: Gemma 2's soft-caps, GPT-OSS's sinks): the same
    tokens and logprobs as ``model.generate``."""
    name, model = arch
    prompts = {"a": prompt(11, 40), "b": prompt(12, 6), "c": prompt(13, 23)}
    sch, events = scheduler(model, mixed_chunk=True), Events()
    add(sch, events, "a", prompts["a"], logprobs=0)
    add(sch, events, "b", prompts["b"], logprobs=0)
    for _ in range(2):
        sch.step(events)
    add(sch, events, "c", prompts["c"], logprobs=0)
    drain(sch, events)
    assert sch.runner.packs
    eager = name in ("gemma2", "gpt_oss")
    assert model.config._attn_implementation == (PACKED_EAGER if eager else PACKED)
    assert sch.mixed_steps > 0
    for rid, ids in prompts.items():
        tokens, logprobs = generate(model, ids)
        assert events.tokens(rid) == tokens, rid
        assert events.logprobs(rid) == pytest.approx(logprobs, abs=1e-4), rid


def test_prefix_reuse_across_the_window(arch: tuple[str, Any]) -> None:
    """A prompt that extends a finished one reuses its cache, windows and all."""
    _, model = arch
    first = prompt(6, 30)
    sch, events = scheduler(model), Events()
    add(sch, events, "first", first)
    drain(sch, events)
    longer = first + events.tokens("first")[:10] + prompt(7, 6)
    add(sch, events, "longer", longer)
    drain(sch, events)
    assert events.cached("longer") == 40
    assert events.tokens("longer") == generate(model, longer)[0]


def test_fixed_shape_decode_equals_generate(arch: tuple[str, Any]) -> None:
    """The decode step CUDA graphs capture (padded rows, bucketed read length) builds
    the same per-layer masks."""
    _, model = arch
    prompts = {"x": prompt(8, 26), "y": prompt(9, 12), "z": prompt(10, 37)}
    sch, events = scheduler(model, fixed_shape_decode=True), Events()
    for rid, ids in prompts.items():
        add(sch, events, rid, ids)
    drain(sch, events)
    assert sch.static_decode is not None and sch.static_decode.steps >= NEW_TOKENS - 1
    for rid, ids in prompts.items():
        assert events.tokens(rid) == generate(model, ids)[0], rid


def test_a_model_with_linear_attention_layers_is_refused(tmp_path: Path) -> None:
    """Layer kinds without a slot cache are a start-up error naming the model."""
    model = build("llama", tmp_path)
    model.config.layer_types = [FULL, "linear_attention", FULL, FULL]
    with pytest.raises(UnsupportedModelError, match=r"LlamaForCausalLM has linear_attention"):
        scheduler(model)


def test_logits_the_runner_cannot_reproduce_are_refused(tmp_path: Path) -> None:
    """A head that post-processes its logits in a way the runner does not know of
    fails the start-up probe instead of serving other tokens."""
    from transformers import LlamaForCausalLM

    class TemperedLlamaForCausalLM(LlamaForCausalLM):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 3.0
            return out

    model = TemperedLlamaForCausalLM(build("llama", tmp_path).config).eval()
    with pytest.raises(UnsupportedModelError, match=r"TemperedLlamaForCausalLM: .* own logits"):
        scheduler(model)


def test_model_facts_are_read_from_the_model(tmp_path: Path) -> None:
    """EOS ids from the generation config (several), the config and the tokenizer
    together; BOS handling from what the tokenizer does; the context from the config."""
    from sluice.engine.model_facts import ModelFacts

    model = build("gemma3_text", tmp_path)
    model.generation_config.eos_token_id = [2, 106]

    class Tokenizer:
        bos_token_id = 1
        eos_token_id = 107

        def encode(self, text: str) -> list[int]:
            return [1, 42]

    facts = ModelFacts.read(model, Tokenizer())
    assert facts.architecture == "Gemma3ForCausalLM"
    assert facts.eos_token_ids == {2, 106, 107}
    assert facts.bos_token_id == 1 and facts.adds_bos
    assert facts.context_length == 256
    card = facts.card()
    assert card["attention"] == {
        "layer_types": {"sliding_attention": 3, "full_attention": 1},
        "sliding_window": WINDOW,
        "implementation": "sdpa",
    }

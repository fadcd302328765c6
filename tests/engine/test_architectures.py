"""The architecture matrix: tiny random models that transformers builds from a config,
served by the step scheduler, token for token equal to ``model.generate``.

Every sliding window (8 positions) is far shorter than the prompts (30–45 tokens), and
prefill runs in 7-token chunks, so a layer masked as full attention, a chunk that
misses its window, or a cached prefix reused across a window changes the tokens. The
logits post-processing (soft-caps, scales) is checked through the logprobs. Each
model builds in well under a second; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sluice.engine.attention import (
    FULL,
    PACKED,
    PACKED_EAGER,
    PACKED_WRAPS,
    SLIDING,
    AttentionLayout,
    UnsupportedModelError,
)
from sluice.engine.speculative import SpeculativeConfig
from tests.support.scheduling import (
    ARCHITECTURES,
    NEW_TOKENS,
    RECURRENT,
    UNPACKED,
    WINDOW,
    Events,
    add,
    build,
    drain,
    generate,
    prompt,
    scheduler,
)

S, F = SLIDING, FULL


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
    # Mamba 2 has no attention layers, and refuses SDPA.
    assert eager == (name in ("gemma2", "gpt_oss", "mpt", "mamba2"))


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
    if name in UNPACKED:  # prefill and decode forwards of their own, the same tokens
        assert not sch.runner.packs and sch.mixed_steps == 0
    else:
        assert sch.runner.packs
        eager = name in ("gemma2", "gpt_oss")
        assert model.config._attn_implementation == (PACKED_EAGER if eager else PACKED)
        assert sch.mixed_steps > 0
    for rid, ids in prompts.items():
        tokens, logprobs = generate(model, ids)
        assert events.tokens(rid) == tokens, rid
        assert events.logprobs(rid) == pytest.approx(logprobs, abs=1e-4), rid


def test_speculative_drafts_equal_generate(arch: tuple[str, Any]) -> None:
    """N-gram drafts verified as multi-token runs (sliding windows, sinks, soft-caps and
    all), beside a prompt being prefilled: the tokens and logprobs of
    ``model.generate``. The prompts repeat themselves, so drafts are found in most steps."""
    name, model = arch
    if name in UNPACKED:
        with pytest.raises(UnsupportedModelError, match=r"ForCausalLM: speculative decoding"):
            scheduler(model, speculative=SpeculativeConfig(num_draft_tokens=4))
        return
    repeated = prompt(14, 12) * 3
    prompts = {"a": repeated, "b": prompt(15, 5) * 4, "c": prompt(16, 9) * 3}
    sch, events = scheduler(model, speculative=SpeculativeConfig(num_draft_tokens=4)), Events()
    add(sch, events, "a", prompts["a"], logprobs=0)
    add(sch, events, "b", prompts["b"], logprobs=0)
    for _ in range(3):
        sch.step(events)
    add(sch, events, "c", prompts["c"], logprobs=0)
    drain(sch, events)
    # Kept drafts too: the random models fall into loops the drafts predict.
    assert sch.accepted_tokens > 0 and sch.mixed_steps > 0
    for rid, ids in prompts.items():
        tokens, logprobs = generate(model, ids)
        assert events.tokens(rid) == tokens, rid
        assert events.logprobs(rid) == pytest.approx(logprobs, abs=1e-4), rid


def test_prefix_reuse_across_the_window(arch: tuple[str, Any]) -> None:
    """A prompt that extends a finished one reuses its cache, windows and all (not a
    recurrent model's: its state sums the whole sequence, and cannot be cut back)."""
    name, model = arch
    first = prompt(6, 30)
    sch, events = scheduler(model), Events()
    add(sch, events, "first", first)
    drain(sch, events)
    longer = first + events.tokens("first")[:10] + prompt(7, 6)
    add(sch, events, "longer", longer)
    drain(sch, events)
    assert events.cached("longer") == (0 if name in RECURRENT else 40)
    assert events.tokens("longer") == generate(model, longer)[0]


def test_fixed_shape_decode_equals_generate(arch: tuple[str, Any]) -> None:
    """The decode step CUDA graphs capture (padded rows, bucketed read length) builds
    the same per-layer masks. A recurrent model decodes at its own shapes: padding rows
    would advance the states of slots they do not own."""
    name, model = arch
    prompts = {"x": prompt(8, 26), "y": prompt(9, 12), "z": prompt(10, 37)}
    sch, events = scheduler(model, fixed_shape_decode=True), Events()
    for rid, ids in prompts.items():
        add(sch, events, rid, ids)
    drain(sch, events)
    if name in RECURRENT:
        assert sch.runner.static is None
    else:
        assert sch.runner.static is not None and sch.runner.static.steps >= NEW_TOKENS - 1
    for rid, ids in prompts.items():
        assert events.tokens(rid) == generate(model, ids)[0], rid


def test_a_layer_kind_without_a_cache_is_refused(tmp_path: Path) -> None:
    """Layer kinds without a slot cache are a start-up error naming the model."""
    model = build("llama", tmp_path)
    model.config.layer_types = [FULL, "indexed_attention", FULL, FULL]
    with pytest.raises(UnsupportedModelError, match=r"LlamaForCausalLM has indexed_attention"):
        scheduler(model)


def test_a_state_space_model_that_drops_its_carried_state_is_refused(tmp_path: Path) -> None:
    """Mamba's selective scan starts every multi-token forward from a zero state, so a
    prompt prefilled in chunks would go on from nothing: refused at start-up."""
    model = build("mamba", tmp_path, {"state_size": 8, "conv_kernel": 4, "expand": 2})
    with pytest.raises(UnsupportedModelError, match=r"MambaForCausalLM: .*carried state"):
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


def test_positions_taken_from_the_whole_batch_are_refused(tmp_path: Path) -> None:
    """A decoder that takes its positions from the cache's length (one number for the
    batch) instead of the ``position_ids`` passed: a single row is right, so the
    self-check's two-row decode step at different positions is what refuses it."""
    import torch

    model = build("llama", tmp_path)
    decoder = model.model
    own_forward = decoder.forward

    def forward(*args: Any, input_ids: Any = None, cache: Any = None, **kwargs: Any) -> Any:
        kwargs.pop("position_ids", None)
        past = cache.get_seq_length() if cache is not None else 0
        rows, width = input_ids.shape
        positions = (torch.arange(width) + past).expand(rows, width)
        return own_forward(
            *args, input_ids=input_ids, cache=cache, position_ids=positions, **kwargs
        )

    decoder.forward = forward
    with pytest.raises(UnsupportedModelError, match=r"LlamaForCausalLM: a row.s logits depend on"):
        scheduler(model)


def test_llama4_is_served_only_below_its_floor_scale(tmp_path: Path) -> None:
    """Llama 4 scales its NoPE layers' queries by one position for the whole batch once
    positions pass ``floor_scale``: a context that reaches it is refused by name."""
    model = build("llama4_text", tmp_path)
    model.config.floor_scale = 200  # the matrix's context is 256
    with pytest.raises(UnsupportedModelError, match=r"--context-length 199 or less"):
        scheduler(model)
    model.config.floor_scale = 257
    scheduler(model)


def test_a_head_that_needs_a_projection_of_its_own_is_refused(tmp_path: Path) -> None:
    """ELECTRA projects the decoder's hidden states to its embedding width before its LM
    head; the runner's head, handed the hidden states as they are, fails: a start-up
    refusal naming the model, not a traceback (the survey found it)."""
    model = build("electra", tmp_path, {"embedding_size": 32})
    with pytest.raises(UnsupportedModelError, match=r"ElectraForCausalLM: its LM head"):
        scheduler(model)

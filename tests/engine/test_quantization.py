"""``--quantization w8a8_int8``: the int8 linears, what is replaced, and that a
request's tokens do not depend on its batch (tiny random models; the real model is
tested end to end in ``test_e2e_quantization.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from sluice.engine.fused_projections import ProjectionMember, SharedProjections, quantization_of
from sluice.engine.int8_projections import Int8Projections, quantize_rows
from sluice.engine.loader import ModelLoadError
from sluice.engine.model_facts import ModelFacts
from sluice.engine.quantization import quantize_model
from tests.support.scheduling import Events, add, build, drain, generate, prompt, scheduler


def linear(seed: int, in_features: int, out_features: int, bias: bool = False) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


def test_rows_round_to_within_half_a_step() -> None:
    x = torch.randn(5, 64) * torch.tensor([[0.01], [1.0], [30.0], [0.0], [2.0]])
    values, scale = quantize_rows(x)
    assert values.dtype == torch.int8 and scale.shape == (5, 1)
    assert int(values.abs().max()) == 127  # each non-zero row spans the full range
    assert torch.all((values.float() * scale - x).abs() <= scale / 2 + 1e-7)
    assert torch.count_nonzero(values[3]) == 0  # an all-zero row stays zero, no NaN


def test_an_int8_linear_is_close_to_the_float_one() -> None:
    lin = linear(0, 96, 40, bias=True)
    x = torch.randn(7, 96)
    out = Int8Projections([lin]).output(x, 0)
    with torch.no_grad():
        expected = lin(x)
    assert out.shape == expected.shape
    assert float((out - expected).norm() / expected.norm()) < 0.02


def test_a_row_gets_the_same_bits_whatever_else_is_in_the_batch() -> None:
    shared = Int8Projections([linear(1, 64, 48)])
    batch = torch.randn(9, 64) * torch.linspace(0.1, 10, 9)[:, None]
    together = shared.output(batch, 0)
    for row in range(9):
        assert torch.equal(shared.output(batch[row : row + 1].clone(), 0)[0], together[row])


def test_fused_projections_equal_each_projection_alone() -> None:
    q, k, v = linear(2, 64, 64), linear(3, 64, 32, bias=True), linear(4, 64, 32)
    fused = Int8Projections([q, k, v])
    x = torch.randn(1, 5, 64)
    members = [ProjectionMember(fused, i, 64) for i in range(3)]
    outs = [m(x) for m in members]
    for out, lin in zip(outs, (q, k, v), strict=True):
        assert torch.equal(out, Int8Projections([lin]).output(x, 0))
    # The shared product is released once every member has read its slice …
    assert fused._output is None
    # … and a member called with another tensor multiplies that one.
    other = torch.randn(1, 2, 64)
    assert torch.equal(members[1](other), Int8Projections([k]).output(other, 0))


@pytest.mark.parametrize(("model_type", "replaced"), [("llama", 28), ("phi3", 16)])
def test_every_decoder_linear_is_replaced_and_the_head_kept(
    model_type: str, replaced: int, tmp_path: Path
) -> None:
    """Llama: q/k/v, o, gate/up, down in 4 layers; Phi-3's already fused qkv and gate/up."""
    model = build(model_type, tmp_path)
    assert quantization_of(model) is None
    assert quantize_model(model, "w8a8_int8", "cpu") == replaced
    assert type(model.get_output_embeddings()) is nn.Linear
    assert not any(type(m) is nn.Linear for m in model.model.layers.modules())
    assert quantization_of(model) == "w8a8_int8"


def test_moe_routers_stay_in_full_precision(tmp_path: Path) -> None:
    model = build("qwen3_moe", tmp_path)
    quantize_model(model, "w8a8_int8", "cpu")
    routers = [m.gate for m in model.model.layers.modules() if hasattr(m, "experts")]
    assert routers and all(not isinstance(r, ProjectionMember) for r in routers)


def test_refusals_name_the_problem(tmp_path: Path) -> None:
    model = build("llama", tmp_path)
    with pytest.raises(ModelLoadError, match="runs on the CPU"):
        quantize_model(model, "w8a8_int8", "cuda")
    with pytest.raises(ModelLoadError, match="unknown --quantization 'int3'"):
        quantize_model(model, "int3", "cpu")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = build("qwen3", tmp_path_factory.mktemp("qwen3"))
    quantize_model(model, "w8a8_int8", "cpu")
    return model


def test_quantized_steps_equal_the_quantized_models_generate(quantized: Any) -> None:
    """Alone and inside a busy batch with mixed steps. The int8 projections are
    row-exact and this model has no near-ties, so the scheduler's tokens are
    ``generate``'s (the real model can part at one: test_e2e_quantization.py)."""
    prompts = {"a": prompt(21, 40), "b": prompt(22, 6), "c": prompt(23, 27)}
    expected = {rid: generate(quantized, ids)[0] for rid, ids in prompts.items()}
    assert len(set(expected["a"])) >= 3, "a degenerate reference would prove little"
    sch, events = scheduler(quantized, mixed_chunk=True), Events()
    add(sch, events, "a", prompts["a"])
    add(sch, events, "b", prompts["b"])
    for _ in range(2):
        sch.step(events)
    add(sch, events, "c", prompts["c"])
    drain(sch, events)
    assert sch.mixed_steps > 0
    for rid in prompts:
        assert events.tokens(rid) == expected[rid], rid
    alone, alone_events = scheduler(quantized), Events()
    add(alone, alone_events, "a", prompts["a"])
    drain(alone, alone_events)
    assert alone_events.tokens("a") == expected["a"]


def test_the_model_card_names_the_method(quantized: Any) -> None:
    class Tokenizer:
        bos_token_id = 1
        eos_token_id = 2
        model_max_length = 256

        def encode(self, text: str) -> list[int]:
            return [5]

    assert ModelFacts.read(quantized, Tokenizer()).card()["quantization"] == "w8a8_int8"


def test_a_gguf_without_packable_linears_is_served_de_quantised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gguf`` chosen for a file whose packable tensors turn out not to be linears (its
    embedding, say): by default the model is served de-quantised, saying why; asked
    for by name, it is a start-up error naming the file and its linears' types."""
    from sluice.engine import gguf_packed
    from sluice.engine.quantization import FLAG, QuantizationChoice, apply_quantization

    model = build("llama", tmp_path)
    monkeypatch.setattr(
        gguf_packed, "pack_model", lambda *_, **__: gguf_packed.PackingReport({}, {"F16": 29})
    )
    source = tmp_path / "m.gguf"
    auto = QuantizationChoice("gguf", "a GGUF file of Q4_0 weights")
    chosen = apply_quantization(model, auto, tmp_path, source)
    assert chosen == QuantizationChoice("none", "the GGUF's linears are F16: none packs")
    packable = r"Q4_0, Q4_1, Q4_K, Q5_0, Q8_0 or Q6_K"
    with pytest.raises(ModelLoadError, match=rf"m\.gguf holds no {packable}"):
        apply_quantization(model, QuantizationChoice("gguf", FLAG), tmp_path, source)


class _AsStored(SharedProjections):
    """A toy quantisation method: the float weights, concatenated, multiplied as they are."""

    method = "toy_as_stored"
    products = 0

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__(linears)
        self.weight = torch.cat([linear.weight.detach() for linear in linears]).t()

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        _AsStored.products += 1
        return rows @ self.weight


def test_a_quantisation_method_is_one_entry_in_apply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seam: a method registered in ``quantization.APPLY`` (here from this module)
    is accepted by name, replaces the linears with its own ``SharedProjections``, and
    the scheduler serves the model through them, greedy-equal to ``model.generate``."""
    from sluice.engine import quantization
    from sluice.engine.fused_projections import replace_linears

    def apply(
        model: Any,
        choice: quantization.QuantizationChoice,
        folder: Path,
        source: Path,
        *,
        compiled: bool,
    ) -> quantization.QuantizationChoice:
        head = model.get_output_embeddings()
        replace_linears(
            model,
            lambda name, linear: linear is not head,
            lambda group: _AsStored([linear for _, linear in group]),
        )
        return choice

    with pytest.raises(ModelLoadError, match="unknown --quantization 'toy_as_stored'"):
        quantization.check_quantization("toy_as_stored", "cpu")
    monkeypatch.setitem(quantization.APPLY, "toy_as_stored", apply)
    model = build("llama", tmp_path)
    ids = prompt(5, 30)
    expected, expected_lps = generate(model, ids)
    choice = quantization.QuantizationChoice("toy_as_stored", quantization.FLAG)
    quantization.check_quantization(choice.method, "cpu")
    assert quantization.apply_quantization(model, choice, tmp_path, tmp_path / "m") == choice
    assert quantization_of(model) == "toy_as_stored"
    products = _AsStored.products
    sch, events = scheduler(model), Events()
    add(sch, events, "a", ids, logprobs=0)
    drain(sch, events)
    assert _AsStored.products > products
    assert events.tokens("a") == expected
    assert events.logprobs("a") == pytest.approx(expected_lps, abs=1e-4)

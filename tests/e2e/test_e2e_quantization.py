"""The quantised engines end to end with the real default model, fp32 around the
quantised GEMMs: ``--quantization w8a8_int8``, and ``gguf``, the default for this
Q4_1 file, started with no ``--quantization`` flag at all, and again with its decode
steps compiled (``--enable-torch-compile``). The served greedy tokens
follow the quantised model's own ``model.generate`` run in this process on this
machine, a busy batch follows each prompt alone, and the model card and
``/server_info`` say what is served. One server of its own per method, started after
the shared one has answered (two never compute at once).

Nothing here pins a text: which int8 rounding step an activation lands on depends on
the CPU's kernels (an AMD EPYC and an Intel Xeon gave "… 311 million" and "… 321
million" for the same prompt), and so does the bfloat16 rounding of the packed int4
GEMM's sums, so each comparison is against a reference computed on the same machine,
with the tolerance stated."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from sluice.engine.kernel_choice import NAMES
from sluice.engine.packed_rows import CANDIDATE_ROWS
from tests.conftest import DEFAULT_GGUF, MODEL_NAME, Server, launch_server, missing_model
from tests.support.greedy import greedy_run
from tests.support.openapi import validate
from tests.support.plain_http import get

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    " ".join(["A long document about rivers, seas and the rain."] * 12),
    "Once upon a time",
]
MAX_TOKENS = 24
TOP = 5  # alternatives per served token, as many as the reference keeps
# SmolLM2's packed projection shapes (out, in, planes): o, down, qkv, gate-up, the head.
SHAPES = [(576, 576, 1), (576, 1536, 1), (960, 576, 1), (3072, 576, 1), (49152, 576, 2)]

# A row's int8 projections are exact whatever the batch, but attention sums in another
# order in a padded batch (or in ``model.generate``), and now and then a last-bit
# difference moves an activation across an int8 rounding step (or a bfloat16 one: the
# int4 GEMM's activations are bfloat16). Measured on an Intel
# Xeon: logprobs agree to ~1e-6, with jumps of up to ~0.3 after such a step, and greedy
# texts part where two candidates are that close. On an AMD EPYC with AVX2 only
# (2026-12-03), a w8a8 busy batch parted from its prompt alone where the two
# candidates were 1.24 nats apart. So tokens are compared while they agree, and where
# they part the two candidates must have been close, by a bound both CPUs meet.
LOGPROB_TOLERANCE = 0.5
NEAR_TIE = 2.0  # nats between the two candidates where two texts may part


@dataclass(frozen=True)
class Step:
    token: str
    logprob: float
    top: dict[str, float]  # the step's best alternatives, the token's own included


# Each server: its quantisation method, and the flags that ask for it (``gguf`` is this
# file's default); ``gguf-compiled`` also decodes one row compiled by inductor (one
# bucket: a cold compile of two took the start past the tests' 300 s on a busy VM).
VARIANTS = {
    "w8a8_int8": ("w8a8_int8", ("--quantization", "w8a8_int8")),
    "gguf": ("gguf", ()),
    "gguf-compiled": ("gguf", ("--enable-torch-compile", "--torch-compile-max-bs", "1")),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def method(variant: str) -> str:
    return VARIANTS[variant][0]


@pytest.fixture(scope="module")
def quantized(variant: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if not DEFAULT_GGUF.exists():
        missing_model("default model missing: run `make model`")
    workdir = tmp_path_factory.mktemp(f"quantized-{variant}")
    flags = VARIANTS[variant][1]  # none: the server's own default
    with launch_server(DEFAULT_GGUF, workdir, MODEL_NAME, *flags, quantization=None) as up:
        yield up


@pytest.fixture(scope="module")
def reference(method: str, quantized: Server) -> tuple[Any, Any]:
    """The weights the server serves, quantised here the way it quantises them: packed
    projections multiply by the kernel the server chose for their shape and switch to
    the dense weight past the row limits it reports (its own measurements, which this
    process could have measured differently)."""
    from sluice.engine.gguf_packed import pack_model, packed_projections
    from sluice.engine.kernel_choice import NAMES
    from sluice.engine.loader import load_causal_lm, load_tokenizer, resolve_model
    from sluice.engine.packed_rows import apply_limits
    from sluice.engine.plane_kernels import KERNELS
    from sluice.engine.quantization import QuantizationChoice, apply_quantization

    resolved = resolve_model(DEFAULT_GGUF)
    model = load_causal_lm(resolved.folder, dtype="float32", device="cpu")
    served = get(f"{quantized.base_url}/server_info").json()["quantization_choice"]
    if method == "gguf":
        pack_model(model, resolved.folder, DEFAULT_GGUF, kernel=None)
        by_name = {name: key for key, name in NAMES.items()}
        kernels = {(e["out"], e["in"], e["planes"]): by_name[e["kernel"]]
                   for e in served["kernels"]["shapes"]}  # fmt: skip
        for projection in packed_projections(model):
            projection.use(KERNELS[kernels[projection.shape]])
        limits = served["packed_rows"]["limits"]
        apply_limits(model, {(e["out"], e["in"], e["planes"]): e["max_rows"] for e in limits})
    else:
        apply_quantization(model, QuantizationChoice(method, "test"), resolved.folder, DEFAULT_GGUF)
    model.generation_config.eos_token_id = None  # as the server's ignore_eos
    return load_tokenizer(resolved.folder), model


def generated(reference: tuple[Any, Any], prompt: str) -> list[Step]:
    tokenizer, model = reference
    run = greedy_run(model, tokenizer(prompt).input_ids, MAX_TOKENS)
    steps = []
    for logits, token in zip(run.logits, run.tokens, strict=True):
        logprobs = logits.log_softmax(-1)
        best = logprobs.topk(5)
        top = {
            tokenizer.decode([i]): float(v)
            for i, v in zip(best.indices.tolist(), best.values, strict=True)
        }
        steps.append(Step(tokenizer.decode([token]), float(logprobs[token]), top))
    return steps


def served(client: openai.OpenAI, prompt: str) -> list[Step]:
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=TOP,
        extra_body={"ignore_eos": True},
    )
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
    assert logprobs.top_logprobs is not None
    steps = zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True)
    return [Step(t, float(lp), dict(top)) for t, lp, top in steps]  # type: ignore[arg-type]


def assert_follows(got: list[Step], want: list[Step]) -> int:
    """``got`` gives ``want``'s tokens with its logprobs while the two agree; where they
    part, ``got``'s token was within ``NEAR_TIE`` of ``want``'s choice at that step.
    Returns how many tokens agreed."""
    assert len(got) == len(want) == MAX_TOKENS
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.token != w.token:
            assert g.token in w.top, f"step {i}: {g.token!r} is not among {w.top}"
            assert w.top[g.token] >= w.logprob - NEAR_TIE, f"step {i}: no near-tie: {w.top}"
            return i
        assert g.logprob == pytest.approx(w.logprob, abs=LOGPROB_TOLERANCE), f"step {i}"
    return len(got)


def test_greedy_tokens_are_the_quantized_models_own(
    quantized: Server, reference: tuple[Any, Any]
) -> None:
    with openai.OpenAI(base_url=quantized.v1, api_key="unused", max_retries=0) as client:
        got = {prompt: served(client, prompt) for prompt in PROMPTS}
    agreed = [assert_follows(got[prompt], generated(reference, prompt)) for prompt in PROMPTS]
    # How far each text agrees is the CPU's to decide (where a near-tie falls); that
    # the prefill's first token agrees is not: none of these prompts is near a tie there.
    assert min(agreed) >= 1, agreed


def test_a_busy_batch_follows_each_prompt_alone(quantized: Server) -> None:
    with openai.OpenAI(base_url=quantized.v1, api_key="unused", max_retries=0) as client:
        alone = [served(client, prompt) for prompt in PROMPTS]
        assert served(client, PROMPTS[0]) == alone[0]  # alone, repeatable to the bit
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: served(client, p), PROMPTS * 2))
    for solo, busy in zip(alone * 2, together, strict=True):
        assert busy[0].token == solo[0].token  # never a near-tie for these prompts
        assert_follows(busy, solo)


def test_the_model_card_and_server_info_say_what_is_served(
    variant: str, method: str, quantized: Server
) -> None:
    with openai.OpenAI(base_url=quantized.v1, api_key="unused", max_retries=0) as client:
        card = client.models.retrieve(MODEL_NAME).model_dump()
    validate("Model", card)
    assert card["quantization"] == method
    info = get(f"{quantized.base_url}/server_info").json()
    assert info["quantization"] == method
    compiled = variant == "gguf-compiled"
    assert info["enable_torch_compile"] is compiled
    assert info["torch_compile_max_bs"] == (1 if compiled else 4)
    # Quantised, a Llama: decoded directly, the start-up check agreeing.
    path = info["decode_path"]
    assert path["path"] == "direct"
    assert path["reason"].startswith("agrees with transformers' layers to ")
    choice = info["quantization_choice"]
    if method == "gguf":  # chosen for the file, every Q4_1 linear packed and the Q8_0 head
        rows = choice.pop("packed_rows")
        # Each shape's kernel: this machine's measurement (``make test`` builds Sluice's
        # own, so both were candidates), so the shapes are pinned and the kernels named.
        kernels = choice.pop("kernels")
        assert kernels["reason"] in ("measured", "measured earlier")
        assert [(e["out"], e["in"], e["planes"]) for e in kernels["shapes"]] == SHAPES
        assert {e["kernel"] for e in kernels["shapes"]} <= set(NAMES.values())
        # float32 around the GEMMs (as the tests serve): no layout of oneDNN's to keep.
        assert choice.pop("dense_layout") == (
            "plain: --enable-torch-compile traces the weights"
            if compiled
            else "plain: oneDNN here does not multiply float32"
        )
        assert choice == {
            "method": "gguf",
            "reason": "a GGUF file of Q4_1, Q8_0 weights",
            "packed": {"Q4_1": 210, "Q8_0": 1},
            "dense": {},
            "requantised": {},
        }
        # Up to how many rows each shape runs packed: this machine's measurement, so
        # the shapes are pinned and the limits only bounded.
        assert rows["reason"] in ("measured", "measured earlier")
        assert [(e["out"], e["in"], e["planes"]) for e in rows["limits"]] == SHAPES
        assert all(e["max_rows"] in (0, *CANDIDATE_ROWS) for e in rows["limits"])
    else:
        assert choice == {"method": "w8a8_int8", "reason": "--quantization"}

"""Every architecture transformers ships as ``…ForCausalLM``, tried as a user would:
a tiny random model built from its config, served by the step scheduler beside
``model.generate`` (issue #25).

For each model type in transformers' causal-LM mapping the survey shrinks the
default config (the size settings it has: hidden size, layers, heads, vocabulary …),
builds the model, saves it and loads it back as the server loads a folder, and serves
two prompts (one several 7-token chunks long, one short, in one busy batch) with
greedy tokens compared with ``model.generate``'s. Each type gets one verdict:

* ``served``: the tokens are ``generate``'s (or, where ``generate``'s cache departs
  from the model's own forward, as Starcoder2's and Moshi's do past their window, the
  greedy tokens of that forward);
* ``refused``: a start-up error naming the architecture (the reason printed);
* ``WRONG``: served with other tokens (a bug: the rule is "refused, never wrong");
* ``CRASHED``: start-up failed with something other than a refusal (a bug);
* ``not tried``: no tiny model could be built or generated from (not Sluice's verdict).

    python -P -m sluice.bench.architecture_survey [model_type …]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import signal
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

SIZES: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    # Other names the same sizes go by.
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 256,
    "d_model": 64,
    "num_layers": 2,
    "ffn_dim": 128,
    "n_inner": 128,
    "decoder_layers": 2,
    "decoder_attention_heads": 4,
    "decoder_ffn_dim": 128,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "sliding_window": 8,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "initializer_range": 0.05,
}
MAX_PARAMS = 20_000_000  # above this the config did not shrink: not a tiny model
SECONDS = 120  # a type that takes longer is reported, not waited for


class _Timeout(Exception):
    pass


def tiny_config(model_type: str) -> Any:
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    sizes = {
        key: value
        for key, value in SIZES.items()
        if hasattr(default, key) and not isinstance(getattr(type(default), key, None), property)
    }
    if getattr(default, "multi_query", False):  # its key/value heads follow from that
        sizes.pop("num_key_value_heads", None)
    config = AutoConfig.for_model(model_type, **sizes)
    types = getattr(config, "layer_types", None)
    if types and len(types) != config.num_hidden_layers:
        config.layer_types = list(types[: config.num_hidden_layers])
    return config


def survey(model_type: str, folder: Path) -> tuple[str, str]:
    from transformers import AutoModelForCausalLM

    from sluice.engine.assembly import build_scheduler
    from sluice.engine.errors import UnsupportedModelError
    from sluice.engine.loader import load_causal_lm
    from sluice.engine.params import SamplingParams, SequenceSpec
    from sluice.engine.scheduler import SchedulerConfig
    from sluice.events.types import TokenSampled

    try:
        config = tiny_config(model_type)
        if getattr(config, "is_encoder_decoder", False):
            return "not tried", "an encoder-decoder model"
        with torch.device("meta"):
            params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if params > MAX_PARAMS:
            return "not tried", f"its config did not shrink ({params:,} parameters)"
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        model = load_causal_lm(folder, dtype="float32", device="cpu")
        model.generation_config.eos_token_id = None
        vocab = int(model.config.vocab_size)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (30, 9)]
        expected = [_generate(model, ids) for ids in prompts]
    # Any failure here is transformers' or the config's, not Sluice's.
    except Exception as exc:  # noqa: BLE001
        return "not tried", f"{type(exc).__name__}: {_line(exc)}"
    try:
        scheduler = build_scheduler(
            model,
            SchedulerConfig(max_running=4, context_length=256, prefill_chunk=7),
            eos_token_ids=frozenset(),
            device=torch.device("cpu"),
        )
    except UnsupportedModelError as exc:
        return "refused", _line(exc)
    # A start-up that fails other than by a refusal is a bug.
    except Exception as exc:  # noqa: BLE001
        return "CRASHED", f"{type(exc).__name__}: {_line(exc)}"
    got: dict[str, list[int]] = {"0": [], "1": []}

    def emit(_sink: Any, event: Any) -> None:
        if isinstance(event, TokenSampled):
            got[event.request_id].append(event.token_id)

    params_ = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, ids in enumerate(prompts):
        scheduler.add(SequenceSpec(str(i), 0, tuple(ids), params_), lambda _batch: None)
    while scheduler.has_work:
        scheduler.step(emit)
    served = [got["0"], got["1"]]
    if served == expected:
        return "served", type(model).__name__
    if served == [_forward_greedy(model, ids) for ids in prompts]:
        return "served", f"{type(model).__name__} (as its own forward; generate disagrees)"
    return "WRONG", f"{type(model).__name__}: {got} against generate's {expected}"


def _generate(model: Any, ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    return [int(t) for t in out[0, len(ids) :]]


def _forward_greedy(model: Any, ids: list[int]) -> list[int]:
    """Greedy tokens from the model's own forward over the whole sequence each step (no
    cache): what Sluice must equal where ``generate``'s cache departs from it."""
    sequence = list(ids)
    with torch.no_grad():
        for _ in range(8):
            logits = model(input_ids=torch.tensor([sequence]), use_cache=False).logits
            sequence.append(int(logits[0, -1].argmax()))
    return sequence[len(ids) :]


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


def _alarm(_signum: int, _frame: Any) -> None:
    raise _Timeout


def main() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("types", nargs="*", help="model types (default: all)")
    args = parser.parse_args()
    types = args.types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    signal.signal(signal.SIGALRM, _alarm)
    counts: dict[str, int] = {}
    for model_type in types:
        signal.alarm(SECONDS)
        try:
            with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stderr(io.StringIO()):
                verdict, why = survey(model_type, Path(folder))
        except _Timeout:
            verdict, why = "not tried", f"over {SECONDS} s"
        finally:
            signal.alarm(0)
        counts[verdict] = counts.get(verdict, 0) + 1
        print(f"{model_type}\t{verdict}\t{why}", flush=True)
    print("\t".join(f"{k}: {v}" for k, v in sorted(counts.items())), file=sys.stderr)


if __name__ == "__main__":
    main()

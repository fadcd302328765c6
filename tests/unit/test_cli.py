"""Start-up errors are one clear line and exit code 2, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DEFAULT_GGUF, REPO, free_port, missing_model


def sluice(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-m", "sluice", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    out = sluice("--model-path", str(tmp_path / "nope.gguf"))
    assert out.returncode == 2
    assert "does not exist" in out.stderr
    assert "Traceback" not in out.stderr


def test_unreadable_gguf_is_a_clear_error(tmp_path: Path) -> None:
    bogus = tmp_path / "broken.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    out = sluice("--model-path", str(bogus))
    assert out.returncode == 2
    assert f"{str(bogus)!r} is not a GGUF file: it starts with b'not '" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("cut", [1000, 50_000_000])  # inside the header, inside the tensors
def test_a_truncated_gguf_is_one_line_naming_the_file(tmp_path: Path, cut: int) -> None:
    if not DEFAULT_GGUF.exists():
        missing_model("default model missing: run `make model`")
    truncated = tmp_path / "cut.gguf"
    with DEFAULT_GGUF.open("rb") as whole:
        truncated.write_bytes(whole.read(cut))
    out = sluice("--model-path", str(truncated))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    [line] = [line for line in out.stderr.splitlines() if "error" in line]
    assert line.startswith(
        f"sluice: error: {str(truncated)!r} is a truncated or corrupt GGUF file ({cut:,} bytes)"
    )


def test_folder_without_config_is_a_clear_error(tmp_path: Path) -> None:
    out = sluice("--model-path", str(tmp_path))
    assert out.returncode == 2
    assert "config.json" in out.stderr


@pytest.mark.model
def test_unknown_chat_template_lists_the_builtin_names() -> None:
    if not DEFAULT_GGUF.exists():
        missing_model("default model missing: run `make model`")
    out = sluice("--chat-template", "no-such-template")
    assert out.returncode == 2
    assert "chatml" in out.stderr and "llama-3" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.model
def test_an_architecture_that_cannot_be_served_is_named(tmp_path: Path) -> None:
    """A model with layers the slot cache cannot hold (indexed sparse attention here) is refused
    at start-up with its architecture named, never served with wrong tokens."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import MODELS

    tokenizer = sorted((MODELS / "cache").glob("SmolLM2-*/tokenizer.json"))
    if not tokenizer:
        missing_model("no converted default model: run `make model`")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        layer_types=["full_attention", "indexed_attention"],
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer[0].parent / name, tmp_path / name)
    out = sluice("--model-path", str(tmp_path), "--port", "0")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "LlamaForCausalLM has indexed_attention layers" in out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("sluice: error: ")


@pytest.mark.model
def test_an_unreachable_postgres_store_is_a_clear_error_without_its_password() -> None:
    if not DEFAULT_GGUF.exists():
        missing_model("default model missing: run `make model`")
    url = f"postgresql://sluice:s3cret@127.0.0.1:{free_port()}/responses"
    out = sluice("--port", str(free_port()), "--responses-db", url)
    assert out.returncode == 2, out.stderr
    assert "cannot open --responses-db postgresql://sluice:***@127.0.0.1" in out.stderr
    assert "s3cret" not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--speculative-num-draft-tokens", "4"], "--speculative-num-draft-tokens needs"),
        (
            ["--speculative-ngram-max-match-window-size", "3"],
            "--speculative-ngram-max-match-window-size needs --speculative-algorithm",
        ),
        (
            ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "0"],
            "must be at least 1",
        ),
        (
            [
                "--speculative-algorithm", "NGRAM",
                "--speculative-ngram-min-match-window-size", "4",
                "--speculative-ngram-max-match-window-size", "2",
            ],
            "n-gram match windows",
        ),
    ],
)  # fmt: skip
def test_speculative_sizes_without_the_algorithm_or_out_of_range_are_refused(
    flags: list[str], message: str
) -> None:
    """Sizes that would do nothing (no algorithm) or cannot work stop the start, before
    any model is read."""
    out = sluice(*flags, "--model-path", "/nonexistent/model.gguf")
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_engine_workers_and_server_info_get_the_one_engine_config() -> None:
    """The engine flags become one ``EngineConfig``: ``--dp-size`` workers are sent it
    settled (the GGUF itself, the dtype and quantisation chosen) and get no engine flags
    of their own; ``/server_info`` reports its speculative sizes in effect (the
    defaults where none was given)."""
    from sluice.cli import build_parser
    from sluice.engine.config import EngineConfig
    from sluice.loading import worker_argv

    args = build_parser().parse_args(
        [
            "--threads",
            "2",
            "--speculative-algorithm",
            "NGRAM",
            "--speculative-num-draft-tokens",
            "5",
            "--disable-mixed-chunk",
        ]
    )
    config = EngineConfig.from_args(args)
    settled = config.settled(model_path="/m.gguf", dtype="float32", quantization="gguf")
    sent = EngineConfig.from_dict(json.loads(json.dumps(settled.to_dict())))
    assert sent == settled
    assert (sent.model_path, sent.dtype, sent.quantization) == ("/m.gguf", "float32", "gguf")
    assert sent.speculative is not None and sent.speculative.num_draft_tokens == 5
    assert not sent.mixed_chunk and sent.threads == 2
    argv = worker_argv(args, 1, "/tmp/s.sock")
    assert not [a for a in argv if a.startswith("--") and a not in WORKER_FLAGS], argv
    assert config.settings()["speculative_algorithm"] == "NGRAM"
    assert {k: v for k, v in config.settings().items() if k.startswith("speculative_")} == {
        "speculative_algorithm": "NGRAM",
        "speculative_num_draft_tokens": 5,
        "speculative_ngram_min_match_window_size": 1,
        "speculative_ngram_max_match_window_size": 12,
    }
    scheduler = sent.scheduler(context_length=4096)
    assert (scheduler.context_length, scheduler.mixed_chunk) == (4096, False)
    plain = EngineConfig.from_args(build_parser().parse_args(["--threads", "2"]))
    assert plain.speculative is None
    assert plain.settings()["speculative_algorithm"] is None


WORKER_FLAGS = {"--engine-worker", "--dp-rank", "--log-format", "--log-level"}

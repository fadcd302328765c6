"""``--dp-size 2`` over a model whose layers carry a recurrent state: a tiny random LFM2
(short convolutions beside attention) with the default model's tokenizer, served by a
real front end over two engine worker processes. Prompts sent at once each come back
with ``model.generate``'s greedy tokens: a worker's engine carries its sequences'
states through chunked prefill and decoding as one engine does."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import launch_server
from tests.support.plain_http import get, post
from tests.support.scheduling import ARCHITECTURES, build, generate, prompt

pytestmark = pytest.mark.model

NEW_TOKENS = 12


def test_a_recurrent_model_serves_through_two_workers(tmp_path: Path, tokenizer_dir: Path) -> None:
    folder = tmp_path / "tiny-lfm2"
    # The tokenizer's vocabulary, so that every id it can give has an embedding.
    model = build("lfm2", folder, {**ARCHITECTURES["lfm2"][1], "vocab_size": 49152})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    prompts = [prompt(seed, length) for seed, length in ((21, 30), (22, 9), (23, 17), (24, 24))]
    expected = [generate(model, ids, NEW_TOKENS)[0] for ids in prompts]

    workdir = tmp_path / "work"
    workdir.mkdir()
    with launch_server(folder, workdir, "tiny-lfm2", "--dp-size", "2", "--threads", "1") as server:

        def run(ids: list[int]) -> list[int]:
            body = {
                "input_ids": ids,
                "sampling_params": {
                    "max_new_tokens": NEW_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
            reply = post(f"{server.base_url}/generate", body).json()
            return [int(t) for t in reply["output_ids"]]

        with ThreadPoolExecutor(len(prompts)) as pool:
            served = list(pool.map(run, prompts))
        info = get(f"{server.base_url}/server_info").json()
    assert served == expected
    assert info["dp_size"] == 2
    assert [w["up"] for w in info["internal_states"]] == [True, True]

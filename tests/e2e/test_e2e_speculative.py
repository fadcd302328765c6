"""``--speculative-algorithm NGRAM`` end to end: a server verifying n-gram drafts answers
the pinned ``openai`` SDK with exactly the shared (non-speculative) server's texts:
greedy and seeded-sampled chat, streamed and not, several choices, and a stop string.
Its metrics show drafts kept, and ``/server_info`` the sizes in effect. Each server's
requests run on their own, so the two engines never compute at once (fp32, the real
default model)."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import DEFAULT_GGUF, MODEL_NAME, Server, launch_server, missing_model
from tests.support.e2e_completions import engine_metric

pytestmark = pytest.mark.model

RECORD = {"id": 4127, "name": "Ada Lovelace", "born": "1815-12-10", "fields": ["mathematics"]}
COPY_JSON = "Copy this JSON exactly, nothing else:\n" + json.dumps(RECORD)
COPY_TEXT = (
    "Repeat the following text word for word:\n\nAda Lovelace was an English "
    "mathematician and writer, chiefly known for her work on the Analytical Engine."
)
ACCEPTED = "sluice_spec_accepted_tokens_total"
DRAFTED = "sluice_spec_draft_tokens_total"


def answers(base_url: str) -> dict[str, Any]:
    """The same requests against one server, three at a time (drafts verified for
    several rows in one step)."""
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:

        def chat(content: str, **kw: Any) -> list[str]:
            out = client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": content}],
                max_tokens=kw.pop("max_tokens", 80),
                **kw,
            )
            return [str(c.message.content) + "|" + str(c.finish_reason) for c in out.choices]

        def streamed(content: str) -> str:
            stream = client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": content}],
                max_tokens=80,
                temperature=0,
                stream=True,
            )
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        def completion() -> str:
            out = client.completions.create(
                model=MODEL_NAME, prompt=COPY_TEXT + "\n\n", max_tokens=40, temperature=0
            )
            return out.choices[0].text

        calls = {
            "greedy_json": lambda: chat(COPY_JSON, temperature=0),
            "greedy_text": lambda: chat(COPY_TEXT, temperature=0),
            "sampled": lambda: chat(COPY_JSON, temperature=0.6, top_p=0.95, seed=5, n=2),
            "stop": lambda: chat(COPY_JSON, temperature=0, stop=["1815"]),
            "streamed": lambda: streamed(COPY_TEXT),
            "completion": completion,
        }
        with ThreadPoolExecutor(3) as pool:
            futures = {name: pool.submit(call) for name, call in calls.items()}
            return {name: future.result() for name, future in futures.items()}


def server_info(server: Server) -> dict[str, Any]:
    with urllib.request.urlopen(f"{server.base_url}/server_info", timeout=10) as response:
        info: dict[str, Any] = json.loads(response.read())
    return info


def test_drafts_verified_give_the_plain_servers_texts(server: Server, tmp_path: Path) -> None:
    if not DEFAULT_GGUF.exists():
        missing_model("default model missing: run `make model`")
    plain = answers(server.v1)
    assert server_info(server)["speculative_algorithm"] is None
    with launch_server(
        DEFAULT_GGUF,
        tmp_path,
        MODEL_NAME,
        "--speculative-algorithm", "NGRAM",
        "--speculative-num-draft-tokens", "6",
    ) as speculative:  # fmt: skip
        got = answers(speculative.v1)
        drafted, kept = engine_metric(speculative, DRAFTED), engine_metric(speculative, ACCEPTED)
        info = server_info(speculative)
    assert got == plain
    assert json.loads(plain["greedy_json"][0].split("|")[0]) == RECORD
    assert plain["stop"][0].endswith("|stop") and "1815" not in plain["stop"][0]
    assert len(plain["sampled"]) == 2
    assert 0 < kept <= drafted
    assert info["speculative_algorithm"] == "NGRAM"
    assert info["speculative_num_draft_tokens"] == 6
    assert info["speculative_ngram_min_match_window_size"] == 1
    assert info["speculative_ngram_max_match_window_size"] == 12

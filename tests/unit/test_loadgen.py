"""The load generator against the HTTP floor server: counts, error taxonomy, ratios, JSON.

No model and no timing assertions: only numbers that must hold on any machine.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from sluice.bench import loadgen
from sluice.bench.engine_worker import EngineWorker, EngineWorkerError
from sluice.bench.floor_server import create_app
from sluice.bench.stats import (
    RATIO_METRICS,
    LatencySummary,
    RequestRecord,
    percentile,
    pool,
    ratio,
    summarise,
)
from tests.support.app_thread import serve

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def app_with(handler: Handler) -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/chat/completions", handler)
    return app


async def run_one_level(cfg: loadgen.LoadConfig, concurrency: int) -> loadgen.RunResult:
    async with aiohttp.ClientSession() as session:
        return await loadgen.run_level(session, cfg, concurrency)


# --- stats --------------------------------------------------------------------------------


def test_percentile_exact_on_small_lists() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    five = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert [percentile(five, q) for q in (0, 25, 50, 75, 100)] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile([0.0, 10.0], 90) == 9.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_ratio_refuses_missing_or_zero() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(1.0, 0.0) is None
    assert ratio(None, 1.0) is None
    assert ratio(1.0, None) is None


def test_summarise_counts_only_successes_and_pool_adds_up() -> None:
    ok = RequestRecord(error=None, latency_s=1.0, ttft_s=0.25, itl_s=[0.5, 0.25], output_tokens=3)
    bad = RequestRecord(error="HTTP 500: boom", latency_s=0.5)
    res = summarise([ok, bad, ok], 2.0, label="x", concurrency=2)
    assert (res.requests, res.errors, res.output_tokens) == (3, 1, 6)
    assert res.error_messages == ["HTTP 500: boom"]
    assert res.req_per_s == 1.0 and res.output_tok_per_s == 3.0 and res.tokens_per_request == 3.0
    assert res.ttft == LatencySummary.of([0.25, 0.25])
    assert res.itl is not None and res.itl.count == 4 and res.itl.p50 == 0.375
    pooled = pool([res, res], label="x")
    assert (pooled.requests, pooled.output_tokens, pooled.wall_s) == (6, 12, 4.0)
    assert pooled.output_tok_per_s == res.output_tok_per_s


# --- against the floor server -------------------------------------------------------------


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_run_level_against_floor(api: loadgen.Api) -> None:
    max_tokens = 16
    with serve(create_app()) as url:
        cfg = loadgen.LoadConfig(
            url=url, model="floor", api=api, max_tokens=max_tokens, requests=16, label="floor"
        )
        res = asyncio.run(run_one_level(cfg, 4))
    assert res.requests == 16
    assert res.errors == 0, res.error_messages
    assert res.output_tokens == 16 * max_tokens
    assert res.tokens_per_request == max_tokens
    assert res.ttft is not None and res.ttft.count == 16 and res.ttft.p50 >= 0
    assert res.ttft.p99 >= res.ttft.p50
    # One token per chunk: every request has max_tokens - 1 gaps between text deltas.
    assert res.itl is not None and res.itl.count == 16 * (max_tokens - 1) and res.itl.p50 >= 0
    assert res.output_tok_per_s > 0 and res.req_per_s > 0


def test_floor_unary_form() -> None:
    async def go(url: str) -> dict[str, object]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{url}/v1/completions", json={"prompt": "a b", "max_tokens": 5}) as r,
        ):
            assert r.status == 200
            body: dict[str, object] = await r.json()
            return body

    with serve(create_app()) as url:
        body = asyncio.run(go(url))
    assert body["object"] == "text_completion"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}


def test_main_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    with serve(create_app()) as url:
        argv = [f"--url={url}", "--concurrency=4", "--requests=16", "--max-tokens=8"]
        rc = loadgen.main([*argv, "--warmup=2", "--no-nice", f"--json={out}"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report) == {"config", "machine", "results", "rounds", "ratios", "raw_step"}
    assert report["config"]["model"] == "floor"  # discovered from GET /v1/models
    (run,) = report["results"]
    assert set(run) == {
        "label", "concurrency", "requests", "errors", "error_messages", "wall_s",
        "output_tokens", "req_per_s", "output_tok_per_s", "tokens_per_request", "ttft_s", "itl_s",
    }  # fmt: skip
    assert (run["requests"], run["errors"], run["output_tokens"]) == (16, 0, 128)
    assert set(run["ttft_s"]) == {"count", "mean", "p50", "p90", "p99", "max"}
    assert report["rounds"] == [] and report["ratios"] == []
    assert "TTFT p50" in capsys.readouterr().out


def test_compare_ratios_are_a_over_b(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp.json"
    with serve(create_app()) as url_a, serve(create_app(model="other")) as url_b:
        rc = loadgen.main(
            [
                f"--url={url_a}", f"--compare={url_b}", "--concurrency=2,4", "--rounds=2",
                "--max-tokens=8", "--warmup=0", "--label-a=alpha", "--label-b=beta",
                "--no-nice", f"--json={out}",
            ]
        )  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["config"]["model_b"] == "other"
    by_key = {(r["label"], r["concurrency"]): r for r in report["results"]}
    assert set(by_key) == {("alpha", 2), ("beta", 2), ("alpha", 4), ("beta", 4)}
    # Pooled over 2 rounds of the default 4×C (min 8) requests each.
    assert by_key["alpha", 2]["requests"] == 16 and by_key["beta", 4]["requests"] == 32
    assert len(report["rounds"]) == 4
    printed = capsys.readouterr().out
    assert "alpha ÷ beta" in printed
    for entry in report["ratios"]:
        a, b = by_key["alpha", entry["concurrency"]], by_key["beta", entry["concurrency"]]
        expected = {
            "output_tok_per_s": a["output_tok_per_s"] / b["output_tok_per_s"],
            "req_per_s": a["req_per_s"] / b["req_per_s"],
            "ttft_p50": a["ttft_s"]["p50"] / b["ttft_s"]["p50"],
            "ttft_p99": a["ttft_s"]["p99"] / b["ttft_s"]["p99"],
            "itl_p50": ratio(a["itl_s"]["p50"], b["itl_s"]["p50"]),
            "itl_p99": ratio(a["itl_s"]["p99"], b["itl_s"]["p99"]),
        }
        assert set(expected) == set(RATIO_METRICS)
        for name, value in expected.items():
            assert entry[name] == value, name
        assert f"{entry['output_tok_per_s']:.3f}" in printed
        assert len(entry["output_tok_per_s_rounds"]) == 2


# --- against the engine alone ---------------------------------------------------------------

# Speaks the engine worker's protocol (bench/engine_only.py --worker) without a model: a
# stray line first, then each request of a run takes 0.5 s of wall between two requests'
# worth of records, 4 tokens 0.1 s apart; the prompts go to the file named in argv[1].
FAKE_WORKER = """
import json, sys
print("a library's stray print")
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if req["op"] == "run":
        with open(sys.argv[1], "a") as seen:
            seen.write(json.dumps(req["prompts"]) + "\\n")
        record = {"error": None, "latency_s": 0.4, "ttft_s": 0.1, "itl_s": [0.1] * 3,
                  "output_tokens": req["max_tokens"]}
        print(json.dumps({"wall_s": 0.5 * len(req["prompts"]),
                          "records": [record] * len(req["prompts"])}), flush=True)
    elif req["op"] == "ceiling":
        print(json.dumps({"batch": req["batch"], "context": req["context"],
                          "step_s": 0.25, "tok_s": req["batch"] / 0.25}), flush=True)
    else:
        print(json.dumps({"error": "unknown op " + repr(req["op"])}), flush=True)
"""


def fake_worker(seen: Path) -> EngineWorker:
    return EngineWorker(command=[sys.executable, "-c", FAKE_WORKER, str(seen)])


def test_engine_worker_client_speaks_the_protocol(tmp_path: Path) -> None:
    worker = fake_worker(tmp_path / "seen.jsonl")
    try:
        res = worker.run(2, ["a b", "c d", "e f"], 4, label="engine-only")
        assert (res.label, res.requests, res.errors, res.output_tokens) == ("engine-only", 3, 0, 12)
        assert res.output_tok_per_s == 12 / 1.5
        assert res.ttft is not None and res.ttft.p50 == 0.1
        assert worker.ceiling(64, 128) == {
            "batch": 64,
            "context": 128,
            "step_s": 0.25,
            "tok_s": 256,
        }
        with pytest.raises(EngineWorkerError, match="unknown op 'nope'"):
            worker._ask({"op": "nope"})
    finally:
        worker.close()
    assert json.loads((tmp_path / "seen.jsonl").read_text()) == ["a b", "c d", "e f"]


def test_engine_rounds_get_the_prompts_the_http_rounds_send(tmp_path: Path) -> None:
    """Server and engine of one round see the same prompts, in the order they are issued."""
    sent: list[str] = []

    async def recording(request: web.Request) -> web.StreamResponse:
        sent.append((await request.json())["prompt"])
        return await sse(TEXT, USAGE, b"[DONE]")(request)

    async def both(url: str, worker: EngineWorker) -> None:
        cfg = loadgen.LoadConfig(url=url, model="m", requests=5, prompt_words=7, seed=3)
        async with aiohttp.ClientSession() as session:
            await loadgen.http_rounds(session, cfg)(1, "round1")
        await loadgen.engine_rounds(worker, cfg, "engine-only")(1, "round1")

    worker = fake_worker(tmp_path / "seen.jsonl")
    try:
        with serve(app_with(recording)) as url:
            asyncio.run(both(url, worker))
    finally:
        worker.close()
    (engine_prompts,) = [json.loads(line) for line in (tmp_path / "seen.jsonl").open()]
    assert len(sent) == 5 and len(set(sent)) == 5 and all(len(p.split()) == 7 for p in sent)
    assert engine_prompts == sent


def test_compare_engine_interleaves_server_and_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen, out = tmp_path / "seen.jsonl", tmp_path / "engine.json"
    monkeypatch.setattr(loadgen, "EngineWorker", lambda **_: fake_worker(seen))
    with serve(create_app()) as url:
        rc = loadgen.main(
            [f"--url={url}", "--compare-engine", "--engine-ceiling", "--concurrency=2",
             "--requests=6", "--max-tokens=8", "--warmup=2", "--no-nice", f"--json={out}"]
        )  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert [(r["label"], r["requests"]) for r in report["results"]] == [
        ("A", 12),
        ("engine-only", 12),
    ]
    # The engine's half: 12 requests of 8 tokens over 2 × 3 s of wall.
    assert report["results"][1]["output_tok_per_s"] == 96 / 6
    (ratios,) = report["ratios"]
    assert ratios["output_tok_per_s"] == report["results"][0]["output_tok_per_s"] / 16
    # A warm-up run, then round 0 and round 1.
    assert [len(json.loads(line)) for line in seen.open()] == [2, 6, 6]
    # Timed after each of the engine's rounds at the top level (2 rounds: 2 steps).
    assert report["raw_step"] == {
        "batch": 2,
        "context": 72,
        "step_s": 0.25,
        "tok_s": 8,
        "rounds_step_s": [0.25, 0.25],
        "engine_over_ceiling": 16 / 8,
    }
    assert "A ÷ engine-only" in capsys.readouterr().out


def test_a_dead_engine_worker_is_an_unusable_system(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = [sys.executable, "-c", "import sys; sys.exit(3)"]
    monkeypatch.setattr(loadgen, "EngineWorker", lambda **_: EngineWorker(command=dead))
    with serve(create_app()) as url:
        argv = [f"--url={url}", "--compare-engine", "--concurrency=1", "--requests=2"]
        assert loadgen.main([*argv, "--warmup=0", "--no-nice"]) == 2
    assert "the engine worker exited (3)" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--api=chat"], ["--duration=1"], ["--compare=http://x"]])
def test_compare_engine_refuses_what_it_cannot_run(extra: list[str]) -> None:
    with pytest.raises(SystemExit):
        loadgen.parse_args(["--url=http://127.0.0.1:1", "--compare-engine", *extra])


@pytest.mark.parametrize(
    "flag", ["--engine-ceiling", "--engine-threads=2", "--engine-dtype=float32"]
)
def test_engine_flags_need_compare_engine(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        loadgen.parse_args(["--url=http://127.0.0.1:1", flag])
    assert "only apply with --compare-engine" in capsys.readouterr().err


# --- errors -------------------------------------------------------------------------------


async def http_500(_request: web.Request) -> web.StreamResponse:
    return web.json_response({"error": {"message": "boom"}}, status=500)


def sse(*events: bytes) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in events:
            await resp.write(b"data: " + event + b"\n\n")
        await resp.write_eof()
        return resp

    return handler


TEXT = b'{"choices":[{"index":0,"text":"hi","finish_reason":null}]}'
USAGE = b'{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'


@pytest.mark.parametrize(
    ("handler", "message"),
    [
        (http_500, "HTTP 500"),
        (sse(TEXT, b'{"error":{"message":"engine died"}}'), "SSE error: engine died"),
        (sse(TEXT, USAGE), "without data: [DONE]"),
        (sse(TEXT, b"[DONE]"), "no usage chunk"),
        (sse(b"{not json"), "JSONDecodeError"),
    ],
)
def test_failures_count_as_errors(handler: Handler, message: str) -> None:
    with serve(app_with(handler)) as url:
        cfg = loadgen.LoadConfig(url=url, model="m", requests=8)
        res = asyncio.run(run_one_level(cfg, 2))
    assert (res.requests, res.errors, res.output_tokens) == (8, 8, 0)
    assert res.req_per_s == 0 and res.ttft is None and res.itl is None
    assert len(res.error_messages) == 5 and message in res.error_messages[0]


def test_main_exit_codes() -> None:
    with serve(app_with(http_500)) as url:
        argv = [f"--url={url}", "--model=m", "--concurrency=1", "--requests=8", "--warmup=0"]
        assert loadgen.main([*argv, "--no-nice"]) == 1
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert loadgen.main([f"--url=http://127.0.0.1:{port}", "--no-nice"]) == 2

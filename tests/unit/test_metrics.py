"""``/metrics``: the exposition parses (a small parser of format 0.0.4 below), counters
move by what the requests did, histograms are cumulative, labels are escaped."""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from sluice.http.app import create_app
from sluice.http.metrics import Counter, Histogram
from sluice.http.state import Lifecycle, ServerState
from tests.support.fake_engine import MODEL, FakeEngine, fake_state

pytestmark = pytest.mark.anyio

Labels = tuple[tuple[str, str], ...]

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(?:,|$)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass
class Family:
    kind: str = ""
    help: str = ""
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)


def _labels(text: str | None) -> Labels:
    if not text:
        return ()
    found: list[tuple[str, str]] = []
    at = 0
    while at < len(text):
        match = _LABEL.match(text, at)
        assert match, f"bad labels: {text!r}"
        value = re.sub(r"\\.", lambda m: _UNESCAPE[m.group()], match.group(2))
        found.append((match.group(1), value))
        at = match.end()
    return tuple(found)


def parse(text: str) -> dict[str, Family]:
    """Families by name; asserts the rules a Prometheus scraper relies on."""
    assert text.endswith("\n")
    families: dict[str, Family] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, help_text = line[7:].split(" ", 1)
            families.setdefault(name, Family()).help = help_text
        elif line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert kind in {"counter", "gauge", "histogram"}
            families.setdefault(name, Family()).kind = kind
        else:
            match = _SAMPLE.fullmatch(line)
            assert match, f"bad sample line: {line!r}"
            name, labels, value = match.group(1), _labels(match.group(2)), match.group(3)
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            histogram = families.get(base, Family()).kind == "histogram"
            family = families.get(base if histogram else name)
            assert family is not None and family.kind, f"{name} sampled before its TYPE"
            assert (name, labels) not in family.samples, f"duplicate sample {line!r}"
            family.samples[(name, labels)] = float(value)
    for name, family in families.items():
        assert family.kind and family.help, name
        if family.kind == "counter":
            assert name.endswith("_total")
        if family.kind == "histogram":
            check_histogram(name, family)
    return families


def check_histogram(name: str, family: Family) -> None:
    series: dict[Labels, list[tuple[float, float]]] = {}
    for (sample, labels), value in family.samples.items():
        if sample == f"{name}_bucket":
            rest = tuple(kv for kv in labels if kv[0] != "le")
            series.setdefault(rest, []).append((float(dict(labels)["le"]), value))
    for labels, buckets in series.items():
        counts = [count for _, count in buckets]
        assert [le for le, _ in buckets] == sorted(le for le, _ in buckets)
        assert counts == sorted(counts), f"{name}{labels} buckets are not cumulative"
        assert buckets[-1][0] == math.inf
        assert family.samples[(f"{name}_count", labels)] == counts[-1]
        assert (f"{name}_sum", labels) in family.samples


def value(families: dict[str, Family], name: str, **labels: str) -> float:
    """One sample; a family's name reads its counter or gauge, ``X_count`` a histogram's."""
    base = re.sub(r"_(sum|count)$", "", name)
    family = families[base] if base in families else families[name]
    wanted = tuple(sorted(labels.items()))
    for (sample, sample_labels), number in family.samples.items():
        if sample == name and tuple(sorted(sample_labels)) == wanted:
            return number
    return 0.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def serving(server: ServerState | Lifecycle) -> AsyncIterator[TestClient[Any, Any]]:
    client = TestClient(TestServer(create_app(server)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def scrape(client: TestClient[Any, Any]) -> dict[str, Family]:
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    return parse(await resp.text())


COMPLETIONS = "/v1/completions"


async def test_counters_and_histograms_follow_the_requests(tokenizer: Any) -> None:
    engine = FakeEngine(tokens=tokenizer.encode(" la"))
    async with serving(fake_state(tokenizer, engine)) as client:
        before = await scrape(client)
        prompt_tokens = 0
        for stream in (False, False, True):
            body = {"model": MODEL, "prompt": "Sing", "max_tokens": 3, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            resp = await client.post(COMPLETIONS, json=body)
            assert resp.status == 200
            if stream:
                text = await resp.text()
                assert text.endswith("data: [DONE]\n\n")
                prompt_tokens += int(re.findall(r'"prompt_tokens":(\d+)', text)[-1])
            else:
                prompt_tokens += (await resp.json())["usage"]["prompt_tokens"]
        assert (await client.post(COMPLETIONS, json={"model": "nope", "prompt": "x"})).status == 400
        assert (await client.get("/no/such/route")).status == 404
        after = await scrape(client)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("sluice_requests_total", route=COMPLETIONS, status="200") == 3
    assert delta("sluice_requests_total", route=COMPLETIONS, status="400") == 1
    assert delta("sluice_requests_total", route="unmatched", status="404") == 1
    assert delta("sluice_requests_total", route="/metrics", status="200") == 1  # ``before``
    assert delta("sluice_generation_tokens_total") == 9
    assert delta("sluice_prompt_tokens_total") == prompt_tokens > 0
    route = {"route": COMPLETIONS}
    assert delta("sluice_time_to_first_token_seconds_count", **route) == 3
    assert delta("sluice_inter_token_latency_seconds_count", **route) == 6  # 2 gaps each
    assert delta("sluice_e2e_request_latency_seconds_count", **route) == 3  # the 400 not
    assert delta("sluice_queue_time_seconds_count", **route) == 3
    assert delta("sluice_e2e_request_latency_seconds_sum", **route) > 0
    for gauge in ("sluice_running_sequences", "sluice_queued_requests"):
        assert after[gauge].kind == "gauge" and value(after, gauge) == 0
    for name in (
        "sluice_waiting_sequences",
        "sluice_admitted_sequences",
        "sluice_kv_cache_usage_bytes",
        "sluice_engine_steps_total",
        "sluice_mixed_steps_total",
        "sluice_spec_draft_tokens_total",
        "sluice_spec_accepted_tokens_total",
        "sluice_prefix_cache_hit_tokens_total",
    ):
        assert name in after


async def test_metrics_answer_while_loading(tokenizer: Any) -> None:
    async with serving(Lifecycle()) as client:
        assert (await client.get("/health")).status == 503
        families = await scrape(client)
    assert value(families, "sluice_requests_total", route="/health", status="503") == 1
    assert value(families, "sluice_running_sequences") == 0


def test_histogram_buckets_are_cumulative_and_le_inclusive() -> None:
    histogram = Histogram("h_seconds", "A test histogram.", (1, 0.1), labels=("route",))
    for observed in (0.1, 0.5, 1.0, 5.0):
        histogram.observe(observed, "/r")
    families = parse("\n".join(histogram.lines()) + "\n")
    samples = families["h_seconds"].samples
    bucket = "h_seconds_bucket"
    assert samples[(bucket, (("route", "/r"), ("le", "0.1")))] == 1  # le is inclusive
    assert samples[(bucket, (("route", "/r"), ("le", "1.0")))] == 3
    assert samples[(bucket, (("route", "/r"), ("le", "+Inf")))] == 4
    assert samples[("h_seconds_sum", (("route", "/r"),))] == pytest.approx(6.6)


def test_label_values_are_escaped() -> None:
    counter = Counter("odd_total", "Odd label values.", ("route", "status"))
    nasty = 'a "quoted" \\ back\nslash'
    counter.inc(nasty, "200", amount=2)
    (line,) = [line for line in counter.lines() if not line.startswith("#")]
    assert "\n" not in line
    families = parse("\n".join(counter.lines()) + "\n")
    assert families["odd_total"].samples == {
        ("odd_total", (("route", nasty), ("status", "200"))): 2.0
    }

"""The load generator's client side: the workload's prompts and payloads, and one
streamed request measured (TTFT, inter-token gaps, tokens), for any OpenAI-compatible
server."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson

from .stats import RequestRecord

# A fixed vocabulary: prompts differ per request (no accidental prefix-cache wins) yet are
# identical for the two systems of a comparison.
_WORD_TEXT = """
    time year people way day man thing woman life child world school state family student
    group country problem hand part place case week company system program question work
    government number night point home water room mother area money story fact month lot
    right study book eye job word business issue side kind head house service friend father
    power hour game line end member law car city community name president team minute idea
    kid body information back parent face others level office door health person art war
    history party result change morning reason research girl guy moment air teacher force
    education river garden market window letter paper music table forest bridge mountain
    island village engine signal bottle pocket ladder basket candle mirror rabbit lantern
    harbor meadow orchard valley thunder compass journey whisper silver copper marble velvet
    quiet gentle bright ancient narrow hollow golden curious patient steady rapid humble
    brave clever distant eager fierce honest loyal modest proud rare simple tender vivid
    build carry climb drift gather wander follow listen notice remember explain imagine
    discover measure balance borrow collect deliver enjoy finish invite kneel launch
    mend offer paint polish repair return shelter travel unfold visit weave yield
    """
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


Api = Literal["completions", "chat"]


class BenchError(Exception):
    """A server could not be used at all (unreachable, no model listed): nothing to measure."""


@dataclass(frozen=True)
class LoadConfig:
    """One target server and the workload sent to it."""

    url: str
    model: str
    api: Api = "completions"
    prompt_words: int = 64
    seed: int = 0
    max_tokens: int = 64
    ignore_eos: bool = True
    api_key: str | None = None
    requests: int | None = None
    duration: float | None = None
    timeout: float = 300.0
    label: str = "A"
    # transformers serve ends its streams without ``data: [DONE]``; the end of the body
    # after a usage chunk is then the end.
    require_done: bool = True
    # Chat: a system message every request shares (what a chat application sends).
    system_prompt: str | None = None


def base_url(url: str) -> str:
    """Accept both `http://host:port` and `http://host:port/v1`."""
    return url.rstrip("/").removesuffix("/v1")


def make_prompt(rng: random.Random, words: int) -> str:
    """Random words rather than a tokenised length: every peer tokenises differently."""
    return " ".join(rng.choices(WORDS, k=words))


def round_prompts(seed: int, concurrency: int, salt: str) -> random.Random:
    """The source of one round's prompts: the same (seed, level, salt), the same prompts,
    drawn in the order the requests are issued, whichever system runs the round."""
    return random.Random(f"{seed}/{concurrency}/{salt}")


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def build_payload(cfg: LoadConfig, prompt: str) -> dict[str, Any]:
    """The PERFORMANCE.md workload: streamed, greedy, fixed length, usage in the last chunk."""
    payload: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": cfg.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.api == "chat":
        system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        payload["messages"] = [*system, {"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    if cfg.ignore_eos:
        payload["ignore_eos"] = True
    return payload


async def fetch_model(session: aiohttp.ClientSession, url: str, api_key: str | None) -> str:
    """The first model id the server lists, so the bench needs no per-peer naming knowledge."""
    try:
        async with session.get(f"{base_url(url)}/v1/models", headers=_headers(api_key)) as resp:
            resp.raise_for_status()
            body = orjson.loads(await resp.read())
        return str(body["data"][0]["id"])
    except (aiohttp.ClientError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchError(f"no model id from {url}/v1/models: {type(exc).__name__}: {exc}") from exc


def _delta_text(obj: dict[str, Any], api: str) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if api == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def _read_stream(
    resp: aiohttp.ClientResponse, api: str, t0: float, require_done: bool = True
) -> RequestRecord:
    """Parse data-only SSE (contract §5.5), timing each non-empty text delta on arrival."""
    ttft: float | None = None
    last = 0.0
    gaps: list[float] = []
    usage_tokens: int | None = None
    done = False
    error: str | None = None
    data_lines: list[bytes] = []

    def handle(data: bytes) -> None:
        nonlocal ttft, last, usage_tokens, done, error
        if done:
            return
        if data.startswith(b"[DONE]"):
            done = True
            return
        obj = orjson.loads(data)
        if not isinstance(obj, dict):
            error = f"SSE data is not an object: {data[:200]!r}"
            return
        if obj.get("error"):
            err = obj["error"]
            message = err.get("message") if isinstance(err, dict) else err
            error = f"SSE error: {message}"
            return
        usage = obj.get("usage")
        if usage:
            usage_tokens = int(usage["completion_tokens"])
        if _delta_text(obj, api):
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now

    async for raw in resp.content:
        line = raw.rstrip(b"\r\n")
        if line:
            if line.startswith(b"data:"):
                data_lines.append(line[5:].removeprefix(b" "))
            continue  # other fields and ':' comments carry nothing we measure
        if data_lines:
            handle(b"\n".join(data_lines))
            data_lines.clear()
        if error is not None:
            break
    if data_lines and error is None:
        handle(b"\n".join(data_lines))  # last event without its blank line
    latency = time.perf_counter() - t0
    if error is None and not done and require_done:
        error = "stream ended without data: [DONE]"
    if error is None and usage_tokens is None:
        error = "no usage chunk (stream_options.include_usage ignored?)"
    if error is not None:
        return RequestRecord(error=error, latency_s=latency)
    return RequestRecord(
        error=None,
        latency_s=latency,
        ttft_s=ttft,
        itl_s=gaps,
        output_tokens=usage_tokens or 0,
    )


async def one_request(
    session: aiohttp.ClientSession, cfg: LoadConfig, prompt: str
) -> RequestRecord:
    """Send one streamed request; every failure becomes an error record, never an exception."""
    path = "/v1/chat/completions" if cfg.api == "chat" else "/v1/completions"
    t0 = time.perf_counter()
    try:
        async with session.post(
            base_url(cfg.url) + path,
            data=orjson.dumps(build_payload(cfg, prompt)),
            headers=_headers(cfg.api_key),
            timeout=aiohttp.ClientTimeout(total=cfg.timeout),
        ) as resp:
            if resp.status != 200:
                body = await resp.text(errors="replace")
                return RequestRecord(
                    error=f"HTTP {resp.status}: {body[:200]}",
                    latency_s=time.perf_counter() - t0,
                )
            return await _read_stream(resp, cfg.api, t0, cfg.require_done)
    except TimeoutError:
        return RequestRecord(
            error=f"timeout after {cfg.timeout:g}s", latency_s=time.perf_counter() - t0
        )
    except (aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:
        # ValueError covers malformed JSON (orjson.JSONDecodeError); Key/TypeError a bad usage.
        return RequestRecord(
            error=f"{type(exc).__name__}: {exc}", latency_s=time.perf_counter() - t0
        )

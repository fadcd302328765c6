"""The HTTP floor: a bare aiohttp server streaming a fixed completion, with no model.

Benching it measures HTTP + JSON + SSE alone (one orjson-encoded SSE write per token, as a
real server does), the floor under which no OpenAI-compatible Python server can go.

    python -m sluice.bench.floor_server --port 8999 --tokens 64
"""

from __future__ import annotations

import argparse
import itertools
import time
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
from aiohttp import web

TOKEN_TEXTS = (" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", ".")


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    err = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    return _json({"error": err}, status)


def _tokens(n: int) -> Iterator[str]:
    return itertools.islice(itertools.cycle(TOKEN_TEXTS), n)


def _usage(prompt: Any, n: int) -> dict[str, int]:
    # A word count stands in for a tokenizer: the floor must cost nothing but transport.
    if isinstance(prompt, list):  # chat messages, or a batch of prompts
        prompt = " ".join(
            str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in prompt
        )
    prompt_tokens = len(str(prompt or "").split())
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": n,
        "total_tokens": prompt_tokens + n,
    }


def create_app(tokens: int = 64, model: str = "floor") -> web.Application:
    """The floor app; `tokens` is the completion length when a request gives no max_tokens."""

    async def models(_request: web.Request) -> web.Response:
        data = {
            "object": "list",
            "data": [{"id": model, "object": "model", "created": 0, "owned_by": "sluice-floor"}],
        }
        return _json(data)

    async def complete(request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return _error(400, "body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object")
        n = body.get("max_completion_tokens") if chat else None
        if n is None:
            n = body.get("max_tokens")
        if n is None:
            n = tokens
        if not isinstance(n, int) or n < 0:
            return _error(400, "max_tokens must be a non-negative integer")
        prompt = body.get("messages") if chat else body.get("prompt")
        base = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", model),
        }
        usage = _usage(prompt, n)
        if not body.get("stream"):
            text = "".join(_tokens(n))
            if chat:
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": None,
                    "finish_reason": "length",
                }
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
                obj = "text_completion"
            unary = {**base, "object": obj, "choices": [choice], "usage": usage}
            return _json(unary)

        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)

        async def send(chunk: dict[str, Any]) -> None:
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")

        def chunk(delta: str | None, finish: str | None) -> dict[str, Any]:
            if chat:
                d: dict[str, Any] = {} if delta is None else {"content": delta}
                c: dict[str, Any] = {"index": 0, "delta": d, "logprobs": None}
            else:
                c = {"index": 0, "text": delta or "", "logprobs": None}
            c["finish_reason"] = finish
            return {**base, "choices": [c], "usage": None}

        if chat:
            first = chunk("", None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": "", "refusal": None}
            await send(first)
        for i, text in enumerate(_tokens(n)):
            await send(chunk(text, "length" if i == n - 1 and not chat else None))
        if chat or n == 0:
            await send(chunk(None, "length"))
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({**base, "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sluice.bench.floor_server", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8999)
    p.add_argument("--tokens", type=int, default=64, help="tokens when a request sets no max")
    p.add_argument("--model", default="floor", help="the id GET /v1/models lists")
    args = p.parse_args(argv)
    web.run_app(
        create_app(args.tokens, args.model), host=args.host, port=args.port, access_log=None
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

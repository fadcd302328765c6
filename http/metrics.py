"""``GET /metrics``: Prometheus text exposition of the engine's state and counters."""

from __future__ import annotations

from aiohttp import web

from sluice.http.state import STATE_KEY

# (name, type, help, attribute of the engine's stats)
_ENGINE_METRICS = (
    ("sluice_running_sequences", "gauge", "Sequences in the engine's batch.", "running"),
    ("sluice_waiting_sequences", "gauge", "Sequences queued for the engine.", "waiting"),
    ("sluice_engine_steps_total", "counter", "Engine steps run.", "steps"),
    ("sluice_generated_tokens_total", "counter", "Tokens sampled.", "generated_tokens"),
    ("sluice_prompt_tokens_total", "counter", "Prompt tokens processed.", "prompt_tokens"),
    (
        "sluice_prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens reused from the prefix cache.",
        "cached_tokens",
    ),
)


async def metrics(request: web.Request) -> web.Response:
    stats = request.app[STATE_KEY].pipeline.engine.stats()
    lines: list[str] = []
    for name, kind, help_text, attribute in _ENGINE_METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines.append(f"{name} {getattr(stats, attribute)}")
    return web.Response(
        text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8",
        headers={"X-Content-Type-Options": "nosniff"},
    )  # fmt: skip

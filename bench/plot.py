"""The bench's plot: output tok/s and TTFT p50 against concurrency, for Sluice, each
peer and the engine ceiling (Sluice's engine with no HTTP), from ``suite.json``.

    python -P -m sluice.bench.plot build/bench/suite.json docs/bench.png

Needs matplotlib (``pip install -e '.[bench]'``). Sluice's points are pooled over its
runs against every peer (each run is interleaved with one peer; their Sluice halves
measure the same thing).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

COLOURS = {
    "sluice": "tab:blue",
    "llama-server": "tab:orange",
    "transformers-serve": "tab:green",
    "engine-only": "tab:gray",
}


def series(record: dict[str, Any], api: str) -> dict[str, dict[int, tuple[float, float | None]]]:
    """{system: {C: (output tok/s, TTFT p50 s)}} for one API; Sluice's runs are pooled by
    summing tokens and wall time (equivalently, weighting by wall time)."""
    sums: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    ttft: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for entry in record["runs"].values():
        if entry["api"] != api:
            continue
        c = entry["concurrency"]
        for role in ("sluice", "other"):
            res = entry.get(role)
            if not res:
                continue
            name = "sluice" if role == "sluice" else entry["peer"]
            sums[name][c][0] += res["output_tokens"]
            sums[name][c][1] += res["wall_s"]
            if res.get("ttft_s"):
                ttft[name][c].append(res["ttft_s"]["p50"])
    out: dict[str, dict[int, tuple[float, float | None]]] = {}
    for name, by_c in sums.items():
        out[name] = {
            c: (tok / wall, sum(ttft[name][c]) / len(ttft[name][c]) if ttft[name][c] else None)
            for c, (tok, wall) in sorted(by_c.items())
            if wall > 0
        }
    return out


def plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    apis = [
        a for a in ("completions", "chat") if any(e["api"] == a for e in record["runs"].values())
    ]
    apis = apis or ["completions"]
    fig, axes = plt.subplots(len(apis), 2, figsize=(11, 4.2 * len(apis)), squeeze=False)
    for row, api in enumerate(apis):
        data = series(record, api)
        tok_ax, ttft_ax = axes[row]
        for name, points in data.items():
            cs = sorted(points)
            style = "--" if name == "engine-only" else "-"
            label = "Sluice engine only (no HTTP)" if name == "engine-only" else name
            colour = COLOURS.get(name)
            tok_ax.plot(cs, [points[c][0] for c in cs], style, marker="o", label=label, c=colour)
            with_ttft = [c for c in cs if points[c][1] is not None]
            if with_ttft:
                ttft_ax.plot(
                    with_ttft,
                    [points[c][1] * 1000 for c in with_ttft],  # type: ignore[operator]
                    style,
                    marker="o",
                    label=label,
                    c=colour,
                )
        raw = record.get("raw_step")
        if raw and api == "completions":
            tok_ax.axhline(
                raw["tok_s"],
                ls=":",
                c="k",
                lw=1,
                label=f"raw batched decode step, B={raw['batch']}",
            )
        for ax, title, unit in (
            (tok_ax, "output tokens/s", "tok/s"),
            (ttft_ax, "TTFT p50", "ms"),
        ):
            ax.set_xscale("log", base=2)
            ax.set_xticks([1, 4, 16, 64], labels=["1", "4", "16", "64"])
            ax.set_xlabel("concurrency (closed loop)")
            ax.set_ylabel(unit)
            ax.set_title(f"{title} — streaming {api}")
            ax.grid(alpha=0.3)
        ttft_ax.set_yscale("log")
        tok_ax.legend(fontsize=8)
    first: dict[str, Any] = next(iter(record["runs"].values()), {})
    machine: dict[str, Any] = first.get("machine", {})
    fig.suptitle(
        f"SmolLM2-135M-Instruct ({record.get('dtype', 'float32')} for Sluice and "
        "transformers serve), 64-word prompts, 64 greedy tokens; "
        f"{machine.get('cpus', '?')} CPUs; ratios only within one interleaved run",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    source = Path(args[0] if args else "build/bench/suite.json")
    target = Path(args[1] if len(args) > 1 else "docs/bench.png")
    plot(json.loads(source.read_text()), target)
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())

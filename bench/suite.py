"""``make bench``: the server over HTTP against its own engine with no HTTP.

Starts Sluice on loopback, runs the load generator (streaming completions, and chat
when the server has the route) at each concurrency, stops it, then runs the
engine-only bench with the same workload — never two engines at once on a small
machine — and prints HTTP ÷ engine-only output tok/s per concurrency. Everything
lands in one JSON file (default ``build/bench/suite.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from sluice.bench.stats import ratio

PY = [sys.executable, "-P"]


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the server did not become healthy")


def run_http(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    url = f"http://127.0.0.1:{args.port}"
    server_cmd = [*PY, "-m", "sluice", "--port", str(args.port), "--threads", str(args.threads),
                  "--log-level", "warning"]  # fmt: skip
    if args.model_path:
        server_cmd += ["--model-path", args.model_path]
    results: dict[str, Any] = {}
    with subprocess.Popen(server_cmd) as proc:
        try:
            _wait_healthy(url, proc)
            for api in args.apis:
                path = out / f"http-{api}.json"
                subprocess.run(
                    [*PY, "-m", "sluice.bench.loadgen", "--url", url, "--api", api,
                     "--concurrency", args.concurrency, "--max-tokens", str(args.max_tokens),
                     "--prompt-words", str(args.prompt_words), "--json", str(path)]
                    + (["--requests", str(args.requests)] if args.requests else []),
                    check=True,
                )  # fmt: skip
                results[api] = json.loads(path.read_text())
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return results


def run_engine(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    path = out / "engine-only.json"
    cmd = [*PY, "-m", "sluice.bench.engine_only", "--concurrency", args.concurrency,
           "--max-tokens", str(args.max_tokens), "--prompt-words", str(args.prompt_words),
           "--threads", str(args.threads), "--json", str(path)]  # fmt: skip
    if args.requests:
        cmd += ["--requests", str(args.requests)]
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    subprocess.run(cmd, check=True)
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="suite", description=__doc__)
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--requests", type=int, help="per level (default: the tools' own)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--model-path")
    p.add_argument("--apis", nargs="+", default=["completions"], choices=["completions", "chat"])
    p.add_argument("--out", type=Path, default=Path("build/bench"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    http = run_http(args, args.out)
    engine = run_engine(args, args.out)
    engine_by_c = {r["concurrency"]: r["output_tok_s"] for r in engine["engine_only"]}
    print("\nconcurrency  api          HTTP tok/s  engine tok/s  HTTP÷engine")
    summary = []
    for api, report in http.items():
        for run in report["results"]:
            c = run["concurrency"]
            r = ratio(run["output_tok_per_s"], engine_by_c.get(c))
            summary.append({"api": api, "concurrency": c, "http_tok_s": run["output_tok_per_s"],
                            "engine_tok_s": engine_by_c.get(c), "ratio": r})  # fmt: skip
            shown = f"{r:.2f}" if r is not None else "n/a"
            print(f"{c:>11}  {api:<11}  {run['output_tok_per_s']:10.1f}  "
                  f"{engine_by_c.get(c, float('nan')):12.1f}  {shown:>11}")  # fmt: skip
    raw = engine["raw_step"]
    print(f"raw batched decode step B={raw['batch']}: {raw['tok_s']:.0f} tok/s ceiling")
    (args.out / "suite.json").write_text(
        json.dumps({"http": http, "engine": engine, "summary": summary}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

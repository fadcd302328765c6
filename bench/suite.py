"""``make bench``: Sluice against its peers, side by side, and against its own engine.

For each peer (``llama-server``, ``transformers serve --continuous-batching``) the suite
starts Sluice and the peer on loopback with the same weights and thread count, runs the
load generator interleaved (A B A B …) at each concurrency, streaming completions and
chat, and stops the peer. llama-server is started anew for each level, configured as its
users run it for that many clients (``-np C``); every row records the command lines of
the systems that produced it, and the summary prints them. A peer that is not installed
or does not start is reported as missing. Then, with only Sluice running, the load
generator runs Sluice's rounds interleaved with rounds of Sluice's engine alone (no
HTTP, in a worker process, the same prompts; ``bench/engine_worker.py``), timing one raw
batched decode step after each of the engine's rounds at the largest level: the engine
ceiling. It prints Sluice ÷ peer for output tok/s, TTFT p50/p99 and ITL p50/p99 per
concurrency, each system's fraction of the bandwidth limit (``bench/bandwidth.py``: the
CPU's read bandwidth is measured before anything starts), and Sluice HTTP ÷ engine-only
the same way, and merges everything into one
JSON file (default ``build/bench/suite.json``) so that a run split by concurrency or
system adds up; the plot (``bench/plot.py``) is drawn from that file.

    python -P -m sluice.bench.suite                                  # everything
    python -P -m sluice.bench.suite --systems llama-server --concurrency 16 --apis chat

``--isa avx512`` (with ``--no-engine``) runs Sluice as on a CPU without AMX
(``bench/emulated_isa.py``): on an Intel Xeon with AMX, a stand-in for a Zen 4 against
the same llama-server, which is built without AMX everywhere. ``--isa avx2`` runs it as
on a CPU with AVX2 alone (a Zen 2 or Zen 3) against llama-server built for that CPU
too. Its rows' machine line says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.bench.bandwidth import read_bandwidth, record_entry, step_bytes
from sluice.bench.emulated_isa import add_isa_argument, emulate
from sluice.bench.machine import machine
from sluice.bench.suite_record import (
    ENGINE,
    format_markdown,
    format_summary,
    load_record,
    merge_loadgen,
)
from sluice.engine.loader import gemm_shapes
from sluice.engine.precision import choose_precision, default_cache_dir

PY = [sys.executable, "-P"]
PEERS = ("llama-server", "transformers-serve")
DEFAULT_GGUF = Path("models/SmolLM2-135M-Instruct.Q4_1.gguf")
LLAMA_SERVER = Path("build/peers/llama-server")
# As on a CPU with AVX2 alone (``--isa avx2``), llama-server built for that CPU too:
# ``LLAMA_ISA=avx2 bench/build_llama_server.sh build/peers-avx2``.
LLAMA_SERVER_AVX2 = Path("build/peers-avx2/llama-server")
TF_VENV = Path("build/peers/tf-serve-venv")


@dataclass
class Server:
    """A server the suite starts: its command, its port, and how it is told to stop."""

    name: str
    cmd: list[str]
    port: int
    env: dict[str, str] | None = None
    health: str = "/health"
    load_timeout: float = 600.0
    model: str | None = None  # the id to send when its /v1/models is no help
    accepts_ignore_eos: bool = True
    sends_done: bool = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class PeerMissing(Exception):
    """A peer is not installed or would not start; the suite reports it and goes on."""


def _wait_healthy(server: Server, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + server.load_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerMissing(f"{server.name} exited with {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(server.url + server.health, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise PeerMissing(f"{server.name} did not become healthy in {server.load_timeout:.0f} s")


def _settle(server: Server, proc: subprocess.Popen[bytes], timeout: float = 180) -> None:
    """Wait until a healthy server is idle (< 10 % of a core over a second): some finish
    allocating caches after answering /health, which would tax the other system's turn."""
    from sluice.bench.frontend import cpu_seconds

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = cpu_seconds(proc.pid)
        time.sleep(1.0)
        if cpu_seconds(proc.pid) - before < 0.1:
            return
    print(f"warning: {server.name} still busy while idle", file=sys.stderr)


@contextlib.contextmanager
def running(server: Server, log_dir: Path) -> Iterator[Server]:
    """Start ``server``, wait until it is healthy, and stop it afterwards."""
    log_path = log_dir / f"{server.name}.log"
    with log_path.open("ab") as log:
        try:
            proc = subprocess.Popen(
                server.cmd, stdout=log, stderr=subprocess.STDOUT, env=server.env
            )
        except OSError as exc:
            raise PeerMissing(f"{server.name}: {exc}") from exc
        try:
            _wait_healthy(server, proc)
            _settle(server, proc)
            yield server
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _thread_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def sluice_server(args: argparse.Namespace) -> Server:
    # As on a CPU with less (``--isa``): the server emulates it as this process does.
    entry = ["sluice"] if args.isa == "native" else ["sluice.bench.emulated_isa", "--isa", args.isa]
    cmd = [*PY, "-m", *entry, "--port", str(args.port), "--threads", str(args.threads),
           "--dtype", args.dtype, "--log-level", "warning", *args.sluice_args]  # fmt: skip
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    return Server("sluice", cmd, args.port, env=_thread_env(args.threads))


def hf_folder(args: argparse.Namespace) -> str:
    """The HF folder Sluice converts the GGUF into: what transformers serve loads."""
    from sluice.engine.loader import resolve_model

    return str(resolve_model(args.model_path).folder)


# Peers whose users size them for the load: started anew for each concurrency level.
PER_LEVEL = frozenset({"llama-server"})


def peer_server(name: str, args: argparse.Namespace, level: int | None = None) -> Server:
    """The peer's command (for one concurrency ``level`` where its users size it by the
    load), or ``PeerMissing`` when it is not installed."""
    port = args.port + 1 + PEERS.index(name)
    threads = str(args.threads)
    if name == "llama-server":
        binary = Path(args.llama_server)
        if not binary.is_file():
            how = "make peers"
            if binary == LLAMA_SERVER_AVX2:
                how = f"LLAMA_ISA=avx2 bench/build_llama_server.sh {LLAMA_SERVER_AVX2.parent}"
            raise PeerMissing(f"llama-server: {binary} not built ({how})")
        gguf = args.gguf or str(DEFAULT_GGUF)
        # As its users run it for C clients on a CPU (its README's server example):
        # one slot per client (-np C), a context of 512 positions per slot (a ≈100-token
        # prompt + 64 tokens), the generation and batch threads both the cores given.
        slots = level or max(args.levels)
        cmd = [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
               "-t", threads, "-tb", threads, "-np", str(slots), "-c", str(512 * slots),
               "--no-webui", "--log-disable", *args.llama_server_args]  # fmt: skip
        return Server(name, cmd, port, env=_thread_env(args.threads), load_timeout=120)
    if name == "transformers-serve":
        exe = Path(args.tf_venv) / "bin" / "transformers"
        if not exe.is_file():
            raise PeerMissing(f"transformers serve: {exe} not installed (make peers)")
        folder = hf_folder(args)
        # Its paged KV cache would otherwise take most of the memory (≈10 GB seen):
        # 2048 blocks of 32 positions hold 64 sequences of 1024 tokens.
        cmd = [str(exe), "serve", folder, "--continuous-batching", "--device", "cpu",
               "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port),
               "--cb-block-size", "32", "--cb-num-blocks", "2048",
               "--log-level", "warning"]  # fmt: skip
        env = _thread_env(args.threads)
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        # It rejects ``ignore_eos``; with 64 tokens every request still ran to the end
        # (the bench counts completion tokens from usage, so a short one would show).
        return Server(
            name, cmd, port, env=env, model=folder, accepts_ignore_eos=False, sends_done=False
        )
    raise ValueError(name)


def run_loadgen(
    args: argparse.Namespace,
    a: Server,
    b: Server | None,
    api: str,
    out: Path,
    levels: str | None = None,
) -> dict[str, Any]:
    cmd = [*PY, "-m", "sluice.bench.loadgen", "--url", a.url, "--api", api,
           "--concurrency", levels or args.concurrency, "--max-tokens", str(args.max_tokens),
           "--prompt-words", str(args.prompt_words), "--json", str(out),
           "--label-a", a.name]  # fmt: skip
    if args.requests:
        cmd += ["--requests", str(args.requests)]
    if b is not None:
        cmd += ["--compare", b.url, "--label-b", b.name, "--rounds", str(args.rounds)]
        if b.model:
            cmd += ["--model-b", b.model]
        if not b.accepts_ignore_eos:
            cmd += ["--no-ignore-eos-b"]
        if not b.sends_done:
            cmd += ["--no-done-b"]
    if args.client_cpus:
        cmd = ["taskset", "-c", args.client_cpus, *cmd]
    # Exit 1 means some requests failed: the numbers (and errors) are still reported.
    subprocess.run(cmd, check=False)
    if not out.exists():
        raise PeerMissing(f"the load generator wrote nothing for {api}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def run_engine_pair(args: argparse.Namespace, sluice: Server, out: Path) -> dict[str, Any]:
    """Sluice over HTTP (A) against its engine with no HTTP (B), interleaved, completions,
    with the engine's raw decode step (the ceiling) timed between its rounds."""
    cmd = [*PY, "-m", "sluice.bench.loadgen", "--url", sluice.url, "--api", "completions",
           "--concurrency", args.concurrency, "--max-tokens", str(args.max_tokens),
           "--prompt-words", str(args.prompt_words), "--json", str(out),
           "--rounds", str(args.rounds), "--label-a", sluice.name, "--label-b", ENGINE,
           "--compare-engine", "--engine-ceiling", "--engine-dtype", args.dtype,
           "--engine-threads", str(args.threads)]  # fmt: skip
    if args.requests:
        cmd += ["--requests", str(args.requests)]
    if args.model_path:
        cmd += ["--engine-model-path", args.model_path]
    subprocess.run(cmd, check=False, env=_thread_env(args.threads))
    if not out.exists():
        raise PeerMissing("the load generator wrote nothing for the engine pair")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def measure_bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    """The read bandwidth and the bench step's bytes, for each row's fraction of the
    bandwidth limit (``bench/bandwidth.py``)."""
    from sluice.engine.loader import load_tokenizer

    folder = Path(hf_folder(args))
    gguf = Path(args.gguf or args.model_path or DEFAULT_GGUF)
    step = step_bytes(gguf, folder, load_tokenizer(folder), args.prompt_words, args.max_tokens)
    return record_entry(read_bandwidth(args.threads), args.threads, step)


def _ran_on(record: dict[str, Any], cpu_line: str) -> bool:
    """Whether some row of ``record`` ran on the CPU ``cpu_line`` names."""
    return any(e.get("machine", {}).get("cpu_line") == cpu_line for e in record["runs"].values())


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -P -m sluice.bench.suite", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--systems",
        default=",".join(PEERS),
        help=f"peers to compare with, comma-separated, from {', '.join(PEERS)}; "
        "'none' for Sluice alone",
    )
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--apis", default="completions,chat", help="completions, chat or both")
    p.add_argument("--requests", type=int, help="per level and round (default 4×C, min 8)")
    p.add_argument("--rounds", type=int, default=2, help="A/B pairs per level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--port", type=int, default=8765, help="Sluice's; peers take the next ones")
    p.add_argument("--model-path", help="Sluice's model (default: the default GGUF)")
    p.add_argument("--gguf", help="llama-server's model (default: the default GGUF)")
    p.add_argument(
        "--llama-server",
        help=f"its binary (default {LLAMA_SERVER}; {LLAMA_SERVER_AVX2} with --isa avx2)",
    )
    p.add_argument("--tf-venv", default=str(TF_VENV))
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="weights and compute of Sluice, its engine-only run and transformers serve "
        "(the same stack gets the same precision; llama-server always runs the GGUF); "
        "auto: what Sluice's --dtype auto picks on this CPU",
    )
    p.add_argument(
        "--sluice-args",
        default="",
        help="extra flags for Sluice, e.g. '--chunked-prefill-size 256' (the engine-only "
        "pair's worker keeps the scheduler defaults: compare it with a default server)",
    )
    p.add_argument(
        "--llama-server-args",
        default="",
        help="extra flags for llama-server, to try its knobs (e.g. '-kvu'); they are part "
        "of the command lines the record keeps",
    )
    p.add_argument("--client-cpus", help="taskset CPU list for the load generator")
    p.add_argument("--no-engine", action="store_true", help="skip Sluice against its engine alone")
    p.add_argument(
        "--engine-only",
        action="store_true",
        help="only Sluice against its engine alone (no peers)",
    )
    p.add_argument("--out", type=Path, default=Path("build/bench"))
    p.add_argument("--fresh", action="store_true", help="start a new record, not merge")
    p.add_argument("--plot", type=Path, default=Path("docs/bench.png"))
    p.add_argument("--no-plot", action="store_true")
    add_isa_argument(p)
    p.add_argument(
        "--report",
        action="store_true",
        help="print the record's tables (Markdown too), run nothing",
    )
    args = p.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.api_list = [a for a in args.apis.split(",") if a]
    args.peer_list = [] if args.systems == "none" else [s for s in args.systems.split(",") if s]
    args.sluice_args = args.sluice_args.split()
    args.llama_server_args = args.llama_server_args.split()
    if args.llama_server is None:
        args.llama_server = str(LLAMA_SERVER_AVX2 if args.isa == "avx2" else LLAMA_SERVER)
    if args.isa != "native" and not args.no_engine:
        # The engine-only pair's worker would load Sluice's kernels as built for this CPU.
        p.error("--isa needs --no-engine")
    # Before ``auto`` is settled: settled as on the emulated CPU, with its kept decisions.
    emulate(args.isa, "sluice.bench.suite")

    # ``auto`` is settled once here, as the server settles it, and given to every stack.
    import torch

    torch.set_num_threads(args.threads)
    args.precision = choose_precision(
        args.dtype, "cpu", lambda: gemm_shapes(Path(hf_folder(args))), cache_dir=default_cache_dir()
    )
    args.dtype = args.precision.dtype
    for s in args.peer_list:
        if s not in PEERS:
            p.error(f"--systems: unknown peer {s!r} (known: {', '.join(PEERS)})")
    if args.client_cpus and not shutil.which("taskset"):
        p.error("--client-cpus needs taskset")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    record_path = args.out / "suite.json"
    record = load_record(record_path, args.fresh)
    # One record holds one precision: a run in another would mix incomparable rows.
    recorded = record.setdefault("dtype", "float32")
    if not args.report and recorded != args.dtype and record["runs"]:
        print(
            f"{record_path} holds {recorded} runs: give --out another folder for "
            f"--dtype {args.dtype} (or --fresh)",
            file=sys.stderr,
        )
        return 2
    record["dtype"] = recorded if args.report else args.dtype
    if not args.report:
        record["precision"] = args.precision.to_dict()
        print(f"precision: {args.precision.line()}")
    # Each CPU's bandwidth, measured where its rows run (or, for a record from before it
    # was kept, when its report is printed on that CPU).
    here = machine()["cpu_line"]
    bandwidths = record.setdefault("bandwidth", {})
    if not args.report or (here not in bandwidths and _ran_on(record, here)):
        bandwidths[here] = measure_bandwidth(args)
        record_path.write_text(json.dumps(record, indent=2))
    if args.report:
        print(format_summary(record))
        print()
        print(format_markdown(record))
        return 0

    def save() -> None:
        record_path.write_text(json.dumps(record, indent=2))

    sluice = sluice_server(args)
    with running(sluice, args.out) as a:
        targets: list[str] = [] if args.engine_only else args.peer_list or ["alone"]
        for name in targets:
            try:
                # A peer sized by the load restarts per level; the others serve all.
                per_level = name in PER_LEVEL
                for level in args.levels if per_level else [None]:
                    peer = None if name == "alone" else peer_server(name, args, level)
                    levels = str(level) if level is not None else None
                    with contextlib.ExitStack() as stack:
                        b = stack.enter_context(running(peer, args.out)) if peer else None
                        commands = {a.name: a.cmd, **({b.name: b.cmd} if b else {})}
                        print("running:", *(shlex.join(c) for c in commands.values()), sep="\n  ")
                        for api in args.api_list:
                            out = args.out / f"{name}-{api}.json"
                            out.unlink(missing_ok=True)
                            report = run_loadgen(args, a, b, api, out, levels)
                            merge_loadgen(record, name, api, report, commands)
                            save()
                record["missing"].pop(name, None)
            except PeerMissing as exc:
                print(f"peer {name}: missing: {exc}", file=sys.stderr)
                record["missing"][name] = str(exc)
            save()
        if not args.no_engine:
            out = args.out / f"{ENGINE}.json"
            out.unlink(missing_ok=True)
            try:
                report = run_engine_pair(args, a, out)
            except PeerMissing as exc:
                print(f"{ENGINE}: missing: {exc}", file=sys.stderr)
                record["missing"][ENGINE] = str(exc)
            else:
                # The worker the load generator starts (bench/engine_worker.py).
                engine_cmd = [*PY, "-m", "sluice.bench.engine_only", "--worker",
                              "--dtype", args.dtype, "--threads", str(args.threads)]  # fmt: skip
                merge_loadgen(
                    record, ENGINE, "completions", report, {a.name: a.cmd, ENGINE: engine_cmd}
                )
                record["raw_step"] = report.get("raw_step") or record.get("raw_step")
                record["missing"].pop(ENGINE, None)
            save()
    print(format_summary(record))
    if not args.no_plot:
        try:
            from sluice.bench.plot import plot
        except ImportError as exc:
            print(f"no plot ({exc}): pip install -e '.[bench]'", file=sys.stderr)
        else:
            plot(record, args.plot)
            print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The bench suite's record (``build/bench/suite.json``): runs merged by (peer, API,
concurrency), each with the CPU it ran on and its command lines, and the tables made
from it (``format_summary`` for the terminal, ``format_markdown`` for
docs/benchmarks.md)."""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import Any

from sluice.bench.bandwidth import fraction_of

ENGINE = "engine-only"  # the engine pair's "peer" in the record


def _key(*parts: object) -> str:
    return "/".join(str(p) for p in parts)


def load_record(path: Path, fresh: bool) -> dict[str, Any]:
    if path.exists() and not fresh:
        record: dict[str, Any] = json.loads(path.read_text())
        if "runs" in record:  # else an older layout: start again
            # Engine-only numbers from before they were interleaved with the server's.
            record.pop("engine", None)
            return record
    return {"runs": {}, "missing": {}, "raw_step": None, "dtype": "float32"}


def merge_loadgen(
    record: dict[str, Any],
    peer: str,
    api: str,
    report: dict[str, Any],
    commands: dict[str, list[str]] | None = None,
) -> None:
    """One entry per (peer or 'alone', api, concurrency): later runs replace earlier ones.
    ``commands`` are the command lines of the systems that ran (label → argv)."""
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    by_c: dict[int, dict[str, Any]] = {}
    for res in report["results"]:
        slot = by_c.setdefault(res["concurrency"], {})
        slot["sluice" if res["label"] == "sluice" else "other"] = res
    for rat in report.get("ratios", []):
        by_c[rat["concurrency"]]["ratios"] = rat
    for c, entry in by_c.items():
        entry.update(peer=peer, api=api, concurrency=c, when=stamp, machine=report["machine"])
        if commands:
            entry["commands"] = {label: shlex.join(argv) for label, argv in commands.items()}
        record["runs"][_key(peer, api, c)] = entry


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _cpu_of(entry: dict[str, Any]) -> str:
    return str(entry.get("machine", {}).get("cpu_line") or "CPU not recorded")


def _cpu_numbers(record: dict[str, Any]) -> dict[str, int]:
    """Each CPU the record's rows ran on, numbered in row order: rows from two CPUs are
    not comparable, and each row says which it came from."""
    ordered = sorted(record["runs"].values(), key=lambda e: (e["peer"], e["api"], e["concurrency"]))
    return {cpu: i for i, cpu in enumerate(dict.fromkeys(map(_cpu_of, ordered)), start=1)}


def format_summary(record: dict[str, Any]) -> str:
    lines = []
    for name, why in record["missing"].items():
        lines.append(f"peer {name}: MISSING ({why})")
    head = (
        f"{'peer':<19}{'api':<12}{'C':>4}{'sluice tok/s':>13}{'peer tok/s':>11}"
        f"{'tok/s':>7}{'TTFT50':>8}{'TTFT99':>8}{'ITL50':>8}{'ITL99':>8}{'bw S/P':>12}"
        f"{'cpu':>5}"
    )
    precision = record.get("dtype", "float32")
    choice = record.get("precision") or {}
    if choice:
        figures = f", bf16 ×{choice['speedup']:.2f}" if choice.get("speedup") is not None else ""
        lines.append(f"precision {precision}: {choice.get('reason')}{figures}")
    cpus = _cpu_numbers(record)
    lines += [f"cpu {n}: {cpu}" for cpu, n in cpus.items()]
    lines += [
        "",
        f"ratios Sluice ÷ peer, {precision} (tok/s: higher is better; latencies: lower;"
        f" peer {ENGINE}: Sluice's engine with no HTTP)",
        head,
    ]
    for entry in sorted(
        record["runs"].values(), key=lambda e: (e["peer"], e["api"], e["concurrency"])
    ):
        sl, pr, rat = entry.get("sluice"), entry.get("other"), entry.get("ratios") or {}
        lines.append(
            f"{entry['peer']:<19}{entry['api']:<12}{entry['concurrency']:>4}"
            f"{_num(sl['output_tok_per_s'] if sl else None):>13}"
            f"{_num(pr['output_tok_per_s'] if pr else None):>11}"
            f"{_x(rat.get('output_tok_per_s')):>7}{_x(rat.get('ttft_p50')):>8}"
            # A space before the ITL ratios: a streamed peer's ITL p50 can be ~0 (tokens
            # of one draft arrive together), and its ratio then needs every column.
            f"{_x(rat.get('ttft_p99')):>8} {_x(rat.get('itl_p50')):>7} {_x(rat.get('itl_p99')):>7}"
            f"{_bandwidth_pair(record, entry):>12}{cpus[_cpu_of(entry)]:>5}"
        )
    lines += _bandwidth_lines(record)
    lines += ["", "command lines (each row's systems, as run):"]
    for entry in sorted(
        record["runs"].values(), key=lambda e: (e["peer"], e["api"], e["concurrency"])
    ):
        for label, command in entry.get("commands", {}).items():
            lines.append(
                f"  {entry['peer']} {entry['api']} C={entry['concurrency']} {label}: {command}"
            )
    raw = record.get("raw_step")
    if raw:
        lines.append(
            f"raw batched decode step B={raw['batch']}: {raw['step_s'] * 1000:.0f} ms "
            f"= {raw['tok_s']:.0f} tok/s ceiling; engine-only at C={raw['batch']} ÷ ceiling "
            f"{_x(raw.get('engine_over_ceiling'))}"
        )
    return "\n".join(lines)


def format_markdown(record: dict[str, Any]) -> str:
    """The same table as ``format_summary``, as Markdown for docs/benchmarks.md."""
    lines = [
        "| peer | API | C | Sluice tok/s | peer tok/s | tok/s ÷ | TTFT p50 ÷ | TTFT p99 ÷ "
        "| ITL p50 ÷ | ITL p99 ÷ | bandwidth S/P | errors S/P | run | CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cpus = _cpu_numbers(record)
    for entry in sorted(
        record["runs"].values(), key=lambda e: (e["peer"], e["api"], e["concurrency"])
    ):
        sl, pr, rat = entry.get("sluice"), entry.get("other"), entry.get("ratios") or {}
        lines.append(
            f"| {entry['peer']} | {entry['api']} | {entry['concurrency']} "
            f"| {_num(sl['output_tok_per_s'] if sl else None)} "
            f"| {_num(pr['output_tok_per_s'] if pr else None)} "
            f"| {_x(rat.get('output_tok_per_s'))} | {_x(rat.get('ttft_p50'))} "
            f"| {_x(rat.get('ttft_p99'))} | {_x(rat.get('itl_p50'))} | {_x(rat.get('itl_p99'))} "
            f"| {_bandwidth_pair(record, entry)} "
            f"| {sl['errors'] if sl else '-'}/{pr['errors'] if pr else '-'} | {entry['when']} "
            f"| {cpus[_cpu_of(entry)]} |"
        )
    lines += ["", *(f"CPU {n}: {cpu}" for cpu, n in cpus.items())]
    lines += _bandwidth_lines(record)
    # Each distinct command line once, in the table's row order.
    ordered = sorted(record["runs"].values(), key=lambda e: (e["peer"], e["api"], e["concurrency"]))
    commands = list(
        dict.fromkeys(
            (label, command) for e in ordered for label, command in e.get("commands", {}).items()
        )
    )
    if commands:
        lines += ["", "Command lines:", "", "```sh"]
        lines += [f"# {label}\n{command}" for label, command in commands]
        lines.append("```")
    return "\n".join(lines)


def _bandwidth_pair(record: dict[str, Any], entry: dict[str, Any]) -> str:
    """Sluice's and the peer's fraction of the bandwidth limit at the row's level."""
    bandwidth, c = record.get("bandwidth", {}).get(_cpu_of(entry)), entry["concurrency"]

    def share(result: dict[str, Any] | None) -> str:
        value = fraction_of(bandwidth, result["output_tok_per_s"] if result else None, c)
        return "-" if value is None else f"{value:.0%}"

    return f"{share(entry.get('sluice'))}/{share(entry.get('other'))}"


def _bandwidth_lines(record: dict[str, Any]) -> list[str]:
    """How the bandwidth fractions were counted (``bench/bandwidth.py``), per CPU."""
    cpus = _cpu_numbers(record)
    lines = []
    for cpu, entry in record.get("bandwidth", {}).items():
        if cpu not in cpus:
            continue
        step = entry["step"]
        lines.append(
            f"bandwidth S/P on cpu {cpus[cpu]}: tok/s × bytes read a token ÷ "
            f"{entry['read_bytes_per_s'] / 1e9:.1f} GB/s (its read bandwidth on "
            f"{entry['threads']} threads, measured); a token reads "
            f"{step['weights'] / 1e6:.1f} MB of the GGUF's weights ÷ C, and "
            f"{step['context']:.0f} cached positions × {step['kv_per_position'] / 1e3:.1f} kB"
        )
    return ["", *lines] if lines else []


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"

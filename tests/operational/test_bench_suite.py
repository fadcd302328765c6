"""The bench suite's record: split runs merge by (peer, API, concurrency), the tables and
the plot's series read it back. No servers, no model; no durations asserted."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from sluice.bench.plot import series
from sluice.bench.suite import main
from sluice.bench.suite_record import (
    ENGINE,
    format_markdown,
    format_summary,
    load_record,
    merge_loadgen,
)


def _result(label: str, c: int, tok_s: float, errors: int = 0) -> dict[str, Any]:
    return {
        "label": label,
        "concurrency": c,
        "errors": errors,
        "output_tokens": int(tok_s * 10),
        "wall_s": 10.0,
        "output_tok_per_s": tok_s,
        "ttft_s": {"p50": 0.5, "p99": 1.0},
    }


def _report(
    c: int, sluice: float, peer: float, name: str = "llama-server", cpu: str = "GenuineIntel · X"
) -> dict[str, Any]:
    return {
        "machine": {"cpus": 2, "cpu_line": cpu},
        "results": [_result("sluice", c, sluice), _result(name, c, peer)],
        "ratios": [{"concurrency": c, "output_tok_per_s": sluice / peer, "ttft_p99": 1.0}],
    }


def test_split_runs_merge_and_a_rerun_replaces_its_row(tmp_path: Path) -> None:
    record = load_record(tmp_path / "missing.json", fresh=False)
    merge_loadgen(record, "llama-server", "completions", _report(1, 10.0, 20.0))
    merge_loadgen(record, "llama-server", "completions", _report(64, 160.0, 80.0))
    merge_loadgen(record, "llama-server", "completions", _report(1, 12.0, 20.0))  # rerun
    assert sorted(record["runs"]) == ["llama-server/completions/1", "llama-server/completions/64"]
    assert record["runs"]["llama-server/completions/1"]["sluice"]["output_tok_per_s"] == 12.0
    assert "| llama-server | completions | 64 | 160.0 | 80.0 | 2.00 |" in format_markdown(record)
    record["missing"]["transformers-serve"] = "not installed"
    assert "transformers-serve: MISSING" in format_summary(record)


def test_each_row_names_the_cpu_it_ran_on() -> None:
    """Rows from two CPUs are not comparable: the tables number the CPUs and say which."""
    record = load_record(Path("/nonexistent"), fresh=True)
    merge_loadgen(record, "llama-server", "completions", _report(1, 10.0, 20.0, cpu="Intel A"))
    merge_loadgen(record, "llama-server", "completions", _report(4, 30.0, 20.0, cpu="AMD B"))
    markdown = format_markdown(record)
    assert "CPU 1: Intel A" in markdown and "CPU 2: AMD B" in markdown
    rows = [line for line in markdown.splitlines() if line.startswith("| llama-server")]
    assert [row.rstrip(" |").rsplit("| ", 1)[1] for row in rows] == ["1", "2"]
    summary = format_summary(record)
    assert "cpu 1: Intel A" in summary and "cpu 2: AMD B" in summary
    assert [line.split()[-1] for line in summary.splitlines() if line.startswith("llama")] == [
        "1",
        "2",
    ]


def test_plot_series_per_system() -> None:
    record = load_record(Path("/nonexistent"), fresh=True)
    merge_loadgen(record, "llama-server", "completions", _report(16, 100.0, 50.0))
    merge_loadgen(record, ENGINE, "completions", _report(16, 140.0, 120.0, name=ENGINE))
    data = series(record, "completions")
    assert data["sluice"][16] == (120.0, 0.5)  # pooled: 2 400 tokens over 20 s
    assert data["llama-server"][16] == (50.0, 0.5)
    assert data[ENGINE][16] == (120.0, 0.5)
    summary = format_summary(record)
    assert "engine-only        completions   16        140.0      120.0   1.17" in summary


def test_engine_numbers_from_before_the_interleaving_are_dropped(tmp_path: Path) -> None:
    old = {"runs": {}, "engine": {"16": {"output_tok_s": 193.5}}, "missing": {}, "dtype": "float32"}
    (tmp_path / "suite.json").write_text(json.dumps(old))
    assert "engine" not in load_record(tmp_path / "suite.json", fresh=False)


def test_a_record_holds_one_precision(tmp_path: Path) -> None:
    """A bfloat16 run refuses to merge into a float32 record (before starting anything)."""
    record = load_record(tmp_path / "suite.json", fresh=False)
    merge_loadgen(record, "llama-server", "completions", _report(1, 10.0, 20.0))
    (tmp_path / "suite.json").write_text(json.dumps(record))
    assert main(["--dtype", "bfloat16", "--out", str(tmp_path), "--no-plot"]) == 2
    assert "float32" in format_summary(load_record(tmp_path / "suite.json", fresh=False))


def test_llama_server_is_sized_for_each_level(tmp_path: Path) -> None:
    """One slot per client of the level being measured, 512 positions each, as its users
    start it for that many clients; not the largest level's slots for every level."""
    from sluice.bench.suite import PER_LEVEL, parse_args, peer_server

    binary = tmp_path / "llama-server"
    binary.write_text("")
    args = parse_args(["--concurrency", "1,16,64", "--threads", "2", "--llama-server", str(binary)])
    assert "llama-server" in PER_LEVEL
    for level in (1, 16, 64):
        cmd = peer_server("llama-server", args, level).cmd
        assert cmd[cmd.index("-np") + 1] == str(level)
        assert cmd[cmd.index("-c") + 1] == str(512 * level)
        assert cmd[cmd.index("-t") + 1] == cmd[cmd.index("-tb") + 1] == "2"


def test_every_rows_command_lines_are_recorded_and_printed() -> None:
    record = load_record(Path("/nonexistent"), fresh=True)
    commands = {
        "sluice": ["python", "-m", "sluice", "--port", "8765"],
        "llama-server": ["llama-server", "-np", "16", "-c", "8192"],
    }
    merge_loadgen(record, "llama-server", "completions", _report(16, 100.0, 50.0), commands)
    entry = record["runs"]["llama-server/completions/16"]
    assert entry["commands"]["llama-server"] == "llama-server -np 16 -c 8192"
    summary = format_summary(record)
    assert "llama-server completions C=16 llama-server: llama-server -np 16 -c 8192" in summary
    markdown = format_markdown(record)
    assert "# sluice\npython -m sluice --port 8765" in markdown
    assert "# llama-server\nllama-server -np 16 -c 8192" in markdown


def test_each_row_gives_both_systems_fraction_of_the_bandwidth_limit() -> None:
    """Against the bandwidth measured on the CPU the row ran on; a row from a CPU with
    no measurement shows none."""
    from sluice.bench.bandwidth import StepBytes, record_entry

    record = load_record(Path("/nonexistent"), fresh=True)
    merge_loadgen(record, "llama-server", "completions", _report(1, 25.0, 50.0, cpu="AMD B"))
    merge_loadgen(record, "llama-server", "completions", _report(4, 30.0, 20.0, cpu="Intel A"))
    step = StepBytes(weights=99_000_000, kv_per_position=0, context=0.0)
    record["bandwidth"] = {"AMD B": record_entry(9.9e9, 2, step)}
    markdown = format_markdown(record)
    assert "| llama-server | completions | 1 | 25.0 | 50.0 | 0.50 |" in markdown
    rows = [line for line in markdown.splitlines() if line.startswith("| llama-server")]
    assert "| 25%/50% |" in rows[0] and "| -/- |" in rows[1]
    assert "bandwidth S/P on cpu 1: tok/s × bytes read a token ÷ 9.9 GB/s" in markdown
    summary = format_summary(record)
    assert "25%/50%" in summary and "99.0 MB of the GGUF's weights" in summary


def test_an_emulated_run_starts_sluice_emulated_and_its_rows_say_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--isa avx512``: the server is started through the emulating entry point, and a
    machine line from such a process names the emulation, so its rows never pass for
    the CPU's own."""
    from sluice.bench import emulated_isa
    from sluice.bench.machine import machine
    from sluice.bench.suite import parse_args, sluice_server

    monkeypatch.setattr(emulated_isa, "emulate", lambda isa, module: None)
    monkeypatch.setattr("sluice.bench.suite.emulate", lambda isa, module: None)
    args = parse_args(["--isa", "avx512", "--no-engine", "--dtype", "bfloat16"])
    cmd = sluice_server(args).cmd
    assert cmd[cmd.index("-m") + 1 : cmd.index("-m") + 4] == [
        "sluice.bench.emulated_isa",
        "--isa",
        "avx512",
    ]
    native = parse_args(["--dtype", "bfloat16"])
    assert sluice_server(native).cmd[sluice_server(native).cmd.index("-m") + 1] == "sluice"
    with pytest.raises(SystemExit):
        parse_args(["--isa", "avx512", "--dtype", "bfloat16"])  # the engine pair is native
    line = machine()["cpu_line"]
    monkeypatch.setenv(emulated_isa.EMULATED, "avx512")
    assert machine()["cpu_line"] == line + " · as avx512 (emulated)"


def test_an_avx2_run_is_paired_with_llama_server_built_for_avx2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--isa avx2`` pairs the emulated server with llama-server built as for that CPU
    (``LLAMA_ISA=avx2``), not the native build; a missing build names how to make it,
    and ``--llama-server`` still picks the binary."""
    from sluice.bench.suite import (
        LLAMA_SERVER,
        LLAMA_SERVER_AVX2,
        PeerMissing,
        parse_args,
        peer_server,
    )

    monkeypatch.setattr("sluice.bench.suite.emulate", lambda isa, module: None)
    common = ["--no-engine", "--dtype", "float32"]
    assert parse_args(["--isa", "avx2", *common]).llama_server == str(LLAMA_SERVER_AVX2)
    assert parse_args(["--isa", "avx512", *common]).llama_server == str(LLAMA_SERVER)
    assert parse_args(common).llama_server == str(LLAMA_SERVER)
    own = tmp_path / "llama-server"
    chosen = parse_args(["--isa", "avx2", "--llama-server", str(own), *common])
    assert chosen.llama_server == str(own)
    own.write_text("")
    assert peer_server("llama-server", chosen, level=4).cmd[0] == str(own)
    monkeypatch.chdir(tmp_path)  # neither default build is here
    with pytest.raises(PeerMissing, match=re.escape("LLAMA_ISA=avx2 bench/build_llama_server.sh")):
        peer_server("llama-server", parse_args(["--isa", "avx2", *common]), level=4)
    with pytest.raises(PeerMissing, match=r"\(make peers\)"):
        peer_server("llama-server", parse_args(common), level=4)

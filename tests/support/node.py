"""Running the Node client scripts of ``tests/node/`` against a server: the skip marks
for a machine without ``node`` or without the pinned packages (``make node`` installs
them), and one run of a script, whose last stdout line is its JSON results."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.conftest import Server

NODE_DIR = Path(__file__).resolve().parents[1] / "node"
NODE = shutil.which("node")
NODE_TIMEOUT = 300  # seconds; each script makes a few small greedy calls
PINNED: dict[str, str] = json.loads((NODE_DIR / "package.json").read_text(encoding="utf-8"))[
    "dependencies"
]


def needs_node(*packages: str) -> list[pytest.MarkDecorator]:
    """Marks that skip a module before any fixture runs (so a skip never starts the
    model server) when ``node`` or one of ``packages`` is missing."""
    modules = NODE_DIR / "node_modules"
    return [
        pytest.mark.skipif(NODE is None, reason="node is not installed"),
        pytest.mark.skipif(
            not all((modules / name / "package.json").exists() for name in packages),
            reason="tests/node/node_modules is incomplete: run `make node`",
        ),
    ]


def run_script(script: str, server: Server, *flags: str) -> dict[str, Any]:
    """Run ``tests/node/<script>`` against the server; its one line of JSON results."""
    assert NODE is not None  # the module is skipped otherwise
    done = subprocess.run(
        [NODE, str(NODE_DIR / script), server.v1, server.model, *flags],
        capture_output=True,
        text=True,
        timeout=NODE_TIMEOUT,
        check=False,
        cwd=NODE_DIR,
    )
    lines = done.stdout.strip().splitlines()
    assert lines, f"no output (exit {done.returncode}); stderr:\n{done.stderr[-4000:]}"
    results: dict[str, Any] = json.loads(lines[-1])
    assert done.returncode == 0 and "error" not in results, (results, done.stderr[-4000:])
    return results

"""``python -m sluice.import_cycles``: the tree has no import cycle, and the checker
finds one hidden in a function, ignores ``TYPE_CHECKING`` imports, and does not count a
package ``__init__`` that imports its own submodules."""

from __future__ import annotations

from pathlib import Path

from sluice.import_cycles import cycles, dependencies, main


def test_the_tree_has_no_import_cycle() -> None:
    assert main() == 0


def graph_of(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    """Modules by dotted name (a package's ``__init__`` under the package's name)."""
    paths = {}
    for name, text in files.items():
        is_package = "." not in name
        path = tmp_path / (name.replace(".", "/") + ("/__init__.py" if is_package else ".py"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        paths[name] = path
    return {name: dependencies(name, path, set(files)) for name, path in paths.items()}


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    graph = graph_of(tmp_path, {
        "p.a": "from .b import x\n",
        "p.b": "def f():\n    from p.a import y\n",
        "p.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.a import z\n",
    })  # fmt: skip
    assert graph == {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": set()}
    assert cycles(graph) == [["p.a", "p.b"]]


def test_a_package_importing_its_submodules_is_no_cycle(tmp_path: Path) -> None:
    graph = graph_of(tmp_path, {
        "q": "from q.one import run\n",
        "q.one": "from q import two\n",  # q/__init__ is already importing: only q.two runs
        "q.two": "X = 1\n",
    })  # fmt: skip
    assert graph == {"q": {"q.one"}, "q.one": {"q.two"}, "q.two": set()}
    assert cycles(graph) == []

"""No first-party module imports itself back, at any depth: ``python -m
sluice.import_cycles`` (``make lint`` runs it) prints every cycle and exits 1 if any.

Imports inside functions count (one placed there to dodge a cycle is still one); those
under ``if TYPE_CHECKING:`` do not (they never run). ``from package import module``
depends on that module alone: the package's ``__init__`` is already importing.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The import package's folders, as pyproject.toml maps them.
PACKAGES = {
    "sluice": "sluice",
    "sluice.events": "events",
    "sluice.pipeline": "pipeline",
    "sluice.engine": "engine",
    "sluice.dataparallel": "dataparallel",
    "sluice.http": "http",
    "sluice.replay": "replay",
    "sluice.bench": "bench",
}


def modules(repo: Path = REPO) -> dict[str, Path]:
    """Every first-party module by its dotted name."""
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in (repo / folder).rglob("*.py"):
            parts = list(path.relative_to(repo / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _runtime_nodes(tree: ast.Module) -> Iterator[ast.AST]:
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def dependencies(name: str, path: Path, known: set[str]) -> set[str]:
    """The first-party modules ``name`` imports when it runs."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = name.split(".") if is_package else name.split(".")[:-1]
            if node.level:
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            submodules = {f"{target}.{a.name}" for a in node.names} & known
            found.update(submodules)
            if len(submodules) < len(node.names):
                found.add(target)
    return (found & known) - {name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def main() -> int:
    found = modules()
    known = set(found)
    graph = {name: dependencies(name, path, known) for name, path in found.items()}
    groups = cycles(graph)
    for group in groups:
        print("import cycle among:", ", ".join(group), file=sys.stderr)
    print(f"{len(found)} modules, {len(groups)} import cycles")
    return 1 if groups else 0


if __name__ == "__main__":
    sys.exit(main())

"""The HTTP edge: aiohttp app, OpenAI routes, protocol validation, SSE, errors.

This folder installs as ``sluice.http``. When the repository root itself is on
``sys.path`` (``python -m …`` or ``python -c`` run from a checkout), Python would
find this folder as the top-level ``http`` and shadow the standard library that
aiohttp needs, so in that case the standard library's package is loaded instead.
"""

if __name__ == "http":  # pragma: no cover - exercised in a subprocess test
    import importlib.util
    import sys
    import sysconfig
    from pathlib import Path

    _stdlib_http = Path(sysconfig.get_paths()["stdlib"]) / "http"
    _spec = importlib.util.spec_from_file_location(
        "http", _stdlib_http / "__init__.py", submodule_search_locations=[str(_stdlib_http)]
    )
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["http"] = _module
    _spec.loader.exec_module(_module)

"""The web page at ``/``: a chat playground and a response-lifecycle viewer.

Plain ES modules and one stylesheet under ``webui/``, shipped in the package and read
once at start-up: nothing is fetched from anywhere else, at build time or at run time.
The page is public (it holds no data; ``--api-key`` servers make it ask for the key,
which its API calls carry), served with a strict Content-Security-Policy (scripts and
styles from this origin only, no inline code, no frames) and an ETag, so a reload
revalidates in one round trip and an upgraded server's page is never stale.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

ASSETS_DIR = Path(__file__).parent / "webui"
PAGE_PREFIX = "/webui/"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# Everything from this origin only; no inline script or style, so text a model wrote
# can never run even if a rendering bug put it into the DOM as markup.
CONTENT_SECURITY_POLICY = "; ".join((
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",
    "connect-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
))  # fmt: skip
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


def load_assets(folder: Path = ASSETS_DIR) -> dict[str, Asset]:
    """Every file of the page, by name, with its ETag (a digest of its bytes)."""
    assets = {}
    for path in sorted(folder.iterdir()):
        content_type = CONTENT_TYPES.get(path.suffix)
        if content_type is None or not path.is_file():
            continue
        body = path.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
        assets[path.name] = Asset(body, content_type, etag)
    return assets


def is_page_path(path: str) -> bool:
    """The page's own paths: public even when API keys are set, served while loading."""
    return path == "/" or path.startswith(PAGE_PREFIX)


def _serve(request: web.Request, asset: Asset) -> web.Response:
    headers = {**SECURITY_HEADERS, "ETag": asset.etag, "Cache-Control": "no-cache"}
    if asset.etag in request.headers.get("If-None-Match", ""):
        return web.Response(status=304, headers=headers)
    return web.Response(body=asset.body, content_type=asset.content_type.split(";")[0],
                        charset="utf-8" if "charset" in asset.content_type else None,
                        headers=headers)  # fmt: skip


def register_webui(app: web.Application) -> None:
    """``GET /`` (the page) and ``GET /webui/{name}`` (its modules and stylesheet)."""
    assets = load_assets()
    index = assets["index.html"]

    async def page(request: web.Request) -> web.Response:
        return _serve(request, index)

    async def asset(request: web.Request) -> web.Response:
        found = assets.get(request.match_info["name"])
        if found is None:
            raise web.HTTPNotFound()
        return _serve(request, found)

    app.router.add_get("/", page)
    app.router.add_get(PAGE_PREFIX + "{name}", asset)

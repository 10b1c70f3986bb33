"""The built-in web chat page: ``/`` and its assets under ``/webui/``, served from the package.

The files (``server/webui/``: the page, its scripts and the vendored libraries with their
licences) are read once when the router is built and kept in memory, each also gzip-compressed,
so the page works with no network and no build step. They are static and carry no secret, so they
are served without the API key; every API call the page makes sends the key the user typed.
"""

from __future__ import annotations

import gzip
import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import PurePosixPath

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tianxia.server.errors import APIError

ASSET_PREFIX = "/webui/"

# The page loads scripts and styles from this server only; `unsafe-inline` styles are for the
# `style` attributes that the MathML renderer writes. Model output goes through DOMPurify too.
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data: blob:; connect-src 'self'; object-src 'none'; base-uri 'self'; "
    "frame-ancestors 'none'"
)


@dataclass(frozen=True, slots=True)
class _Asset:
    body: bytes
    gzipped: bytes
    media_type: str
    etag: str


_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".png": "image/png",
    ".svg": "image/svg+xml",
}


def _media_type(name: str) -> str:
    """By suffix; the licence files and the README are plain text."""
    return _MEDIA_TYPES.get(PurePosixPath(name).suffix, "text/plain; charset=utf-8")


def _load_assets() -> dict[str, _Asset]:
    """Every file under ``server/webui/``, keyed by its URL path."""
    root = resources.files("tianxia.server") / "webui"
    assets: dict[str, _Asset] = {}

    def walk(node, rel: str) -> None:
        for child in node.iterdir():
            name = f"{rel}{child.name}"
            if child.is_dir():
                walk(child, name + "/")
            elif child.is_file():
                body = child.read_bytes()
                etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
                url = "/" if name == "index.html" else ASSET_PREFIX + name
                assets[url] = _Asset(body, gzip.compress(body, 9, mtime=0), _media_type(name), etag)

    walk(root, "")
    return assets


def build_router() -> tuple[APIRouter, frozenset[str]]:
    """The router serving the page, and the paths it serves."""
    assets = _load_assets()
    router = APIRouter()

    def serve(path: str, request: Request) -> Response:
        asset = assets.get(path)
        if asset is None:
            return APIError(404, f"The web page has no file {path}.", code="not_found").response()
        # revalidated on every load (no-cache + ETag), so a new version is picked up at once
        headers = {"ETag": asset.etag, "Cache-Control": "no-cache", "Vary": "Accept-Encoding",
                   "X-Content-Type-Options": "nosniff"}
        if path == "/":
            headers["Content-Security-Policy"] = _CSP
        if asset.etag in request.headers.get("if-none-match", ""):
            return Response(status_code=304, headers=headers)
        body = asset.body
        if "gzip" in request.headers.get("accept-encoding", "") and len(asset.gzipped) < len(body):
            body, headers["Content-Encoding"] = asset.gzipped, "gzip"
        return Response(body, media_type=asset.media_type, headers=headers)

    @router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def index(request: Request) -> Response:
        return serve("/", request)

    @router.api_route(
        ASSET_PREFIX + "{name:path}", methods=["GET", "HEAD"], include_in_schema=False
    )
    async def asset(name: str, request: Request) -> Response:
        return serve(ASSET_PREFIX + name, request)

    return router, frozenset(assets)

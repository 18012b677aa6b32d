"""The operator dashboard (``GET /ui``): three static files from ``balancer/ui``, no build step.

Served without the token: the page holds no data, and asks for the token before it calls the
API (docs/dashboard.md). Its headers keep a page that renders client-chosen strings (session
keys, addresses) from ever running them: a Content-Security-Policy that allows only its own
script and style and talks only to this listener, no MIME sniffing, no caching, no referrer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from aiohttp import web

__all__ = ["HEADERS", "PATHS", "add_routes"]

HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
}

# route -> (file in balancer/ui, content type)
_FILES = {
    "/ui": ("index.html", "text/html"),
    "/ui/app.js": ("app.js", "text/javascript"),
    "/ui/style.css": ("style.css", "text/css"),
}
PATHS = frozenset({*_FILES, "/ui/"})  # what the admin API serves without the token


def _read(name: str) -> bytes:
    """Read at each request: a few kilobytes, and an edited file shows on reload."""
    return resources.files("balancer").joinpath("ui", name).read_bytes()


def _handler(name: str, content_type: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def serve(request: web.Request) -> web.Response:
        return web.Response(
            body=_read(name), content_type=content_type, charset="utf-8", headers=HEADERS
        )

    return serve


async def _slash(request: web.Request) -> web.Response:
    """``/ui/`` -> ``/ui``: one address for the page, whose links are absolute anyway."""
    raise web.HTTPPermanentRedirect("/ui", headers=HEADERS)


def add_routes(router: web.UrlDispatcher) -> None:
    """``GET /ui`` (the page), ``/ui/app.js``, ``/ui/style.css``; ``/ui/`` redirects."""
    for path, (name, content_type) in _FILES.items():
        router.add_get(path, _handler(name, content_type))
    router.add_get("/ui/", _slash)

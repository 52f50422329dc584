"""`GET /`: the playground page for a browser, from package data (api/playground/).

A browser (`Accept: text/html` preferred to JSON) gets the page; an API client keeps the JSON
404 it always had. The page and its files hold no data, so they load without the API key (the
page sends the key the user types with each API call it makes). Every answer forbids anything
but the page's own files: no inline script or style, nothing fetched from another host.
"""

from __future__ import annotations

from importlib.resources import files

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import NotFound

from api.http.state import ServerState

PAGE = "index.html"
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
# Only the page's own files: its scripts, its styles, its API calls; `data:` for the icon.
CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src 'self' data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated, so a new version of the server is seen at once
}


def page_files() -> dict[str, bytes]:
    """The page's files by name, read once from the package (nothing else is served)."""
    folder = files("api.playground")
    return {
        entry.name: entry.read_bytes()
        for entry in folder.iterdir()
        if entry.is_file() and _suffix(entry.name) in TYPES
    }


def public_paths() -> frozenset[str]:
    """What loads without the API key: the page and its files."""
    return frozenset({"/", *(f"/playground/{name}" for name in page_files())})


def wants_html() -> bool:
    """A browser's navigation prefers HTML; `curl` (*/*) and API clients get JSON."""
    best = request.accept_mimetypes.best_match(["application/json", "text/html"])
    return best == "text/html"


def register(app: QuartTrio, state: ServerState) -> None:
    contents = page_files()

    def answer(name: str) -> Response:
        return Response(contents[name], 200, {"Content-Type": TYPES[_suffix(name)], **HEADERS})

    @app.get("/")
    async def playground() -> Response:
        if not wants_html():
            raise NotFound()
        return answer(PAGE)

    @app.get("/playground/<name>")
    async def playground_file(name: str) -> Response:
        if name not in contents:
            raise NotFound()
        return answer(name)


def _suffix(name: str) -> str:
    return name[name.rfind(".") :] if "." in name else ""

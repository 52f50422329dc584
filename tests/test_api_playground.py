"""`GET /` and the playground's files (api/routes/playground.py) against the fake engine, and
what the page's files may not hold; the page in a browser: tests/test_playground.py."""

from __future__ import annotations

import re
from importlib.resources import files
from pathlib import Path

from api.app import create_app
from api.http.state import ServerSettings
from tests.api_helpers import MODEL
from tests.fake_engine import FakeEngine

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
KEY = "a-key"


async def test_a_browser_gets_the_page_and_an_api_client_json() -> None:
    app = create_app(FakeEngine(), ServerSettings(served_model_name=MODEL, api_key=KEY))
    async with app.test_app() as test_app:
        client = test_app.test_client()
        page = await client.get("/", headers={"Accept": BROWSER_ACCEPT})  # no key: it holds none
        assert page.status_code == 200 and page.mimetype == "text/html"
        csp = page.headers["Content-Security-Policy"]
        for directive in ("default-src 'none'", "script-src 'self'", "style-src 'self'"):
            assert directive in csp
        assert "connect-src 'self'" in csp and "img-src 'self' data:" in csp
        assert page.headers["X-Content-Type-Options"] == "nosniff"
        for name, kind in [("main.js", "text/javascript"), ("playground.css", "text/css")]:
            asset = await client.get(f"/playground/{name}")
            assert asset.status_code == 200 and asset.mimetype == kind
            assert asset.headers["X-Content-Type-Options"] == "nosniff"
        for accept in ("*/*", "application/json"):  # curl, API clients: the JSON 404 as before
            api = await client.get("/", headers={"Accept": accept})
            assert api.status_code == 404 and "error" in await api.get_json()
        bearer = {"Authorization": f"Bearer {KEY}"}  # only the page's own files are public
        assert (await client.get("/playground/nope.js", headers=bearer)).status_code == 404
        assert (await client.get("/v1/models")).status_code == 401  # the API still wants it


def test_the_page_has_no_inline_code_and_uses_no_other_host() -> None:
    folder = files("api.playground")
    texts = {e.name: e.read_text() for e in folder.iterdir() if e.name.endswith((".html", ".js"))}
    html = texts["index.html"]
    assert all("src=" in tag for tag in re.findall(r"<script[^>]*>", html))
    assert not re.search(r"<style|\sstyle=|\son\w+=", html)  # no inline style nor handlers
    for name, text in texts.items():
        assert not re.search(r"https?://", text), name  # nothing fetched from another host
        if name.endswith(".js"):  # text goes in as text: nothing is parsed as HTML or code
            forbidden = r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(|Function\("
            assert not re.search(forbidden, text), name


def test_docs_screenshot_is_committed() -> None:
    """The README shows docs/playground.png (written by tools/playground_screenshot.py)."""
    shot = Path(__file__).resolve().parents[1] / "docs" / "playground.png"
    assert shot.exists() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_element_the_scripts_name_is_in_the_page() -> None:
    """`$("id")` and getElementById("id") in the modules, and the JSON boxes with their error
    lines (settings.js names those as `${name}-error`)."""
    folder = files("api.playground")
    html = folder.joinpath("index.html").read_text()
    ids = set(re.findall(r'\sid="([\w-]+)"', html))
    named = {"schema-error", "tools-error"}
    for entry in folder.iterdir():
        if entry.name.endswith(".js"):
            named |= set(re.findall(r'(?:\$|getElementById)\("([\w-]+)"\)', entry.read_text()))
    assert len(named) > 15 and named <= ids, named - ids
    settings = set(re.findall(r'data-setting="(\w+)"', html))
    assert {"schema", "tools", "tool_choice"} <= settings

"""The playground page in a browser, for tests/test_playground.py and
tests/test_playground_tools.py: Debian's chromium under playwright, a tab that records what the
page reported and what it asked, the page's controls, and chat streams a test serves itself."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tools.playground_screenshot import CHROMIUM, launch


def chromium() -> Iterator[Any]:
    """Debian's chromium (`playwright install` is never run), or a skip that says how to get it;
    a module's `browser` fixture yields from this."""
    if not CHROMIUM.exists():
        pytest.skip(f"no chromium at {CHROMIUM} (Debian: apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a dev extra")
    with sync_api.sync_playwright() as playwright:
        browser = launch(playwright)
        yield browser
        browser.close()


@dataclass
class Tab:
    """A page in a fresh browser context, with what its console reported and what it asked."""

    page: Any
    errors: list[str] = field(default_factory=list)
    bodies: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (path, JSON)
    urls: list[str] = field(default_factory=list)


def open_tab(browser: Any, url: str, key: str | None) -> Tab:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    if key is not None:  # as if typed earlier in this tab (sessionStorage)
        context.add_init_script(f"sessionStorage.setItem('playground.apiKey', {json.dumps(key)})")
    tab = Tab(context.new_page())
    tab.page.on("console", lambda m: m.type == "error" and tab.errors.append(m.text))
    tab.page.on("pageerror", lambda e: tab.errors.append(str(e)))
    tab.page.on("request", lambda r: record(tab, r))
    tab.page.goto(url + "/")
    return tab


def record(tab: Tab, request: Any) -> None:
    tab.urls.append(request.url)
    if request.method == "POST" and "/v1/" in request.url:
        path = "/" + request.url.split("/", 3)[3]
        tab.bodies.append((path, json.loads(request.post_data)))


def models_listed(page: Any) -> None:
    page.wait_for_function("() => document.querySelector('#model').options.length > 0")


def loads_shown(page: Any) -> None:
    """The live panel has polled /v1/loads."""
    page.wait_for_function("() => /^\\d+$/.test(document.getElementById('load-running').innerText)")


def set_field(page: Any, selector: str, value: str | bool) -> None:
    if isinstance(value, bool):
        page.set_checked(selector, value)
    else:
        page.fill(selector, value)
        page.dispatch_event(selector, "change")


def send(page: Any, text: str) -> None:
    """Type and send; returns once the new reply has ended."""
    replies = page.locator(".msg.assistant").count()
    page.fill("#input", text)
    page.press("#input", "Enter")
    page.wait_for_function(
        "n => document.querySelectorAll('.msg.assistant').length > n"
        " && !document.querySelector('.msg.streaming')",
        arg=replies,
    )


def last_reply(page: Any) -> Any:
    return page.locator(".msg.assistant").last


def chat_stream(choices: list[dict[str, Any]]) -> str:
    """A chat stream we control (the real tiny model cannot be made to say what it holds): one
    chunk per choice, then [DONE]."""
    head = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "tiny"}
    start = {"delta": {"role": "assistant", "content": ""}}
    events = [head | {"choices": [{"index": 0} | choice]} for choice in [start, *choices]]
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def serve_stream(page: Any, stream: str, times: int | None = None) -> None:
    """The page's chat requests answered with `stream` (the first `times` of them)."""
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, content_type="text/event-stream", body=stream),
        times=times,
    )

"""Draw docs/playground.png, the README's picture of the playground page: `runtime serve` with
the default model, the page in Debian's chromium, two questions answered (the second with the
per-token view, one token hovered).

    python -m tools.playground_screenshot [OUT]

Needs the dev extra (playwright) and `apt-get install -y chromium`; never `playwright install`.
tests/test_playground.py launches chromium with the same arguments.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")  # Debian's package
CHROMIUM_ARGS = [
    *("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"),
    *("--disable-background-networking", "--disable-component-update", "--disable-sync"),
]
QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow."]


def launch(playwright: Any) -> Any:
    """Debian's chromium, headless, with nothing that reaches out to the network by itself."""
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)


def start_server() -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "runtime.cli.main", "serve", "--port", "0"]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    assert server.stderr is not None
    for line in server.stderr:
        ready = re.search(r"serving \S+ at (http://\S+)", line)
        if ready:  # its log read on, so that it never blocks on a full pipe
            threading.Thread(target=server.stderr.read, daemon=True).start()
            return server, ready.group(1)
    raise SystemExit(f"the server did not start (exit status {server.wait()})")


def ask(page: Any, question: str) -> None:
    count = page.locator(".msg.assistant").count()
    page.fill("#input", question)
    page.press("#input", "Enter")
    page.wait_for_function(
        "n => document.querySelectorAll('.msg.assistant').length > n"
        " && !document.querySelector('.msg.streaming')",
        arg=count,
    )


def draw(url: str, out: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = launch(playwright)
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        page.goto(url + "/")
        page.wait_for_function("() => document.querySelector('#model').options.length > 0")
        for name, value in [("temperature", "0"), ("max_tokens", "64")]:
            page.fill(f"[data-setting={name}]", value)
            page.dispatch_event(f"[data-setting={name}]", "change")
        ask(page, QUESTIONS[0])
        page.check("[data-setting=logprobs]")
        ask(page, QUESTIONS[1])
        page.hover(".msg.assistant >> nth=1 >> .tok >> nth=3")
        page.wait_for_function("() => /\\d/.test(document.getElementById('load-kv').textContent)")
        page.screenshot(path=str(out))
        browser.close()


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/playground.png")
    server, url = start_server()
    try:
        draw(url, out)
    finally:
        server.terminate()
        server.wait()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""The playground page (api/playground/) in Debian's chromium, driven by playwright, against
`runtime serve` (its route's answers: tests/test_api_playground.py).

One chromium and one server (tiny llama, float32, with an API key) per module; each test has
its own browser context, so its own storage. They skip where chromium is not installed
(`apt-get install -y chromium`; .ci/run installs it). The browser's helpers:
tests/playground_page.py; the JSON-schema and tools boxes: tests/test_playground_tools.py.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.playground_page import (
    Tab,
    chat_stream,
    chromium,
    last_reply,
    loads_shown,
    models_listed,
    open_tab,
    send,
    serve_stream,
    set_field,
)
from tests.server_process import ServerProcess, metric, wait_until

KEY = "playground-test-key"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from chromium()


@pytest.fixture(scope="module")
def server(
    browser: Any, llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    key_file = tmp_path_factory.mktemp("playground-key") / "key"
    key_file.write_text(KEY)
    # float32 and greedy replies (temperature 0): the same tokens on any machine, as the
    # parity tests see them, so no early end of text on another CPU
    proc = ServerProcess(llama_dir, "--dtype", "float32", "--api-key-file", str(key_file))
    yield proc
    assert proc.terminate() == 0, proc.log


@pytest.fixture
def tab(browser: Any, server: ServerProcess) -> Iterator[Tab]:
    opened = open_tab(browser, server.url, KEY)
    models_listed(opened.page)
    yield opened
    opened.page.context.close()


def test_the_page_loads_without_console_errors(tab: Tab) -> None:
    page = tab.page
    assert page.title() == "trio-llm-runtime playground"
    assert page.locator("#model option").all_inner_texts() == ["tiny"]
    loads_shown(page)
    assert page.inner_text("#load-kv").endswith("%")
    assert tab.errors == []


def test_a_reply_streams_and_grows(
    tab: Tab, server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    page = tab.page
    set_field(page, "[data-setting=max_tokens]", "96")
    set_field(page, "[data-setting=temperature]", "0")
    page.evaluate(GROWTH_OBSERVER)
    send(page, "Tell me about lists.")
    lengths = page.evaluate("() => window.replyLengths")
    text = last_reply(page).locator(".body").inner_text()
    assert text and len(set(lengths)) >= 3 and lengths == sorted(lengths), lengths
    stats = last_reply(page).locator(".stats").inner_text()
    assert re.fullmatch(r"TTFT \d+ ms · [\d.]+ tok/s · 96 tokens · length", stats), stats
    path, body = tab.bodies[-1]
    assert path == "/v1/chat/completions" and body["stream"] and body["temperature"] == 0
    shot = tmp_path_factory.mktemp("playground") / "playground.png"  # the test's artifact
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000
    assert tab.errors == []


# Records the growing reply's length at every change of the page (until it stops streaming).
GROWTH_OBSERVER = """() => {
  window.replyLengths = [];
  new MutationObserver(() => {
    const reply = document.querySelector('.msg.assistant.streaming .body');
    if (reply) window.replyLengths.push(reply.textContent.length);
  }).observe(document.getElementById('messages'),
             {childList: true, subtree: true, characterData: true});
}"""


def test_stop_frees_the_request_on_the_server(tab: Tab, server: ServerProcess) -> None:
    page = tab.page
    set_field(page, "[data-setting=max_tokens]", "1500")
    set_field(page, "[data-setting=temperature]", "0")
    generated = metric(server, "runtime:generation_tokens_total")
    page.fill("#input", "Keep talking.")  # its greedy reply runs all 1500 tokens
    page.press("#input", "Enter")
    page.wait_for_function("() => document.querySelector('.msg.streaming .body')?.textContent")
    assert metric(server, "runtime:num_requests_running") == 1
    page.click("#stop")
    stopped = time.monotonic()
    freed = wait_until(lambda: metric(server, "runtime:num_requests_running") == 0, 1.0, 0.02)
    assert freed, f"still running {time.monotonic() - stopped:.2f} s after Stop"
    page.wait_for_selector(".msg.streaming", state="detached")
    assert last_reply(page).locator(".stats").inner_text().endswith("stopped")
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    assert metric(server, "runtime:generation_tokens_total") - generated < 1500  # cut short
    assert tab.errors == []


HOSTILE = [
    'Look: <img src=x onerror="window.pwned=1">',
    " and <script>window.pwned=2</script>",
    '\n```html\n<b>bold</b><img src=x onerror="window.pwned=3">\n```\n',
]


def hostile_stream() -> str:
    """The text above, one chunk each, with a top alternative that is markup too."""
    choices: list[dict[str, Any]] = []
    for piece in HOSTILE:
        top = [{"token": piece, "logprob": -0.1}, {"token": "<img src=y>", "logprob": -2.5}]
        entry = {"token": piece, "logprob": -0.1, "bytes": list(piece.encode())}
        entry["top_logprobs"] = top
        choices.append({"delta": {"content": piece}, "logprobs": {"content": [entry]}})
    return chat_stream([*choices, {"delta": {}, "finish_reason": "stop"}])


def test_model_output_is_shown_as_text_and_runs_nothing(tab: Tab) -> None:
    page = tab.page
    serve_stream(page, hostile_stream())
    set_field(page, "[data-setting=logprobs]", True)  # first the per-token view
    send(page, "Say something nasty.")
    body = last_reply(page).locator(".body")
    assert body.inner_text() == "".join(HOSTILE)
    page.hover(".msg.assistant .tok >> nth=0")
    assert '"<img src=y>"' in page.inner_text("#tip")
    assert page.evaluate("() => document.getElementById('tip').children.length") == 0
    set_field(page, "[data-setting=logprobs]", False)  # then the text view, with its fences
    assert body.inner_text().startswith(HOSTILE[0] + HOSTILE[1])
    assert body.locator("pre").inner_text().strip() == HOSTILE[2].split("\n")[2]
    assert page.locator("#messages *:is(img, script, b)").count() == 0
    assert page.evaluate("() => window.pwned") is None
    assert tab.errors == []


def test_settings_and_conversations_survive_a_reload(tab: Tab) -> None:
    page = tab.page
    settings = {
        "temperature": "0.7", "top_p": "0.9", "top_k": "40", "min_p": "0.05",
        "max_tokens": "4", "seed": "5", "presence_penalty": "0.5",
        "frequency_penalty": "0.25", "repetition_penalty": "1.1",
    }  # fmt: skip
    for name, value in settings.items():
        set_field(page, f"[data-setting={name}]", value)
    set_field(page, "[data-setting=system]", "Be brief.")
    set_field(page, "[data-setting=stop]", "END\nSTOP")
    send(page, "Remember me")
    page.reload()
    models_listed(page)
    for name, value in settings.items():
        assert page.input_value(f"[data-setting={name}]") == value, name
    assert page.input_value("#system") == "Be brief."
    assert page.input_value("#api-key") == KEY  # sessionStorage: this tab, until it closes
    assert KEY not in page.evaluate("() => JSON.stringify(localStorage)")
    assert page.locator(".msg.user").inner_text().endswith("Remember me")
    send(page, "Again")
    path, body = tab.bodies[-1]
    assert path == "/v1/chat/completions"
    sent = {name: body[name] for name in settings}
    assert sent == {name: float(value) for name, value in settings.items()}
    assert body["stop"] == ["END", "STOP"] and body["model"] == "tiny"
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert [m["content"] for m in body["messages"][1:]][::2] == ["Remember me", "Again"]
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0
    assert page.locator("#conversation-list li").count() == 2
    assert tab.errors == []


def test_regenerate_edit_and_completion_mode(tab: Tab) -> None:
    page = tab.page
    set_field(page, "[data-setting=max_tokens]", "8")
    set_field(page, "[data-setting=temperature]", "0")
    send(page, "first")
    page.click("#regenerate")
    page.wait_for_function("() => !document.querySelector('.msg.streaming')")
    assert page.locator(".msg").count() == 2 and len(tab.bodies) == 2
    assert tab.bodies[0][1]["messages"] == tab.bodies[1][1]["messages"]
    page.click("#edit-last")
    assert page.input_value("#input") == "first" and page.locator(".msg").count() == 0
    page.click("[data-mode=completion]")
    send(page, "Once upon a time")
    path, body = tab.bodies[-1]
    assert path == "/v1/completions" and body["prompt"] == "Once upon a time"
    assert last_reply(page).locator(".stats").inner_text().endswith("8 tokens · length")
    assert tab.errors == []


def test_a_server_with_a_key_and_a_key_typed_into_the_page(
    browser: Any, server: ServerProcess
) -> None:
    tab = open_tab(browser, server.url, key=None)
    page = tab.page
    page.wait_for_selector("#notice:not([hidden])")
    assert "API key" in page.inner_text("#notice")
    set_field(page, "#api-key", KEY)
    models_listed(page)
    assert page.is_hidden("#notice")
    loads_shown(page)
    assert not any(KEY in url for url in tab.urls)  # sent in a header, never in a URL
    assert KEY not in page.evaluate("() => JSON.stringify(localStorage)")
    assert tab.errors and all("401" in error for error in tab.errors)  # the key-less calls
    page.context.close()

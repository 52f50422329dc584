"""A tool loop through the trio client: the model calls a local function, its result goes back
as a `tool` message, and the model answers with it.

    python examples/tool_loop.py ["What is the weather in Paris?"] [--url URL] [--model DIR]

Without --url it starts `runtime serve --enable-auto-tool-choice --tool-call-parser hermes`
(the default model, SmolLM2-135M-Instruct, unless --model) and stops it at the end. The first
turn asks with tool_choice "required" (a 135 M model rarely chooses a tool by itself under
"auto"; larger ones do), the last with "none", so that the model answers in words (SmolLM2
often just repeats the tool's result).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere: the client lives in this repository

from api.client import Client  # noqa: E402


def get_weather(city: str, unit: str = "celsius") -> dict[str, Any]:
    """A stand-in for a real weather service."""
    return {"city": city, "temperature": 21 if unit == "celsius" else 70, "sky": "sunny"}


def add(a: int, b: int) -> int:
    return a + b


SYSTEM = "You are a helpful assistant. Answer in one sentence, with the tools' results."
FUNCTIONS: dict[str, Callable[..., Any]] = {"get_weather": get_weather, "add": add}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
]  # fmt: skip


async def converse(client: Client, question: str) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    print(f"user: {question}")
    reply = await client.chat(messages, tools=TOOLS, tool_choice="required",
                              parallel_tool_calls=False, temperature=0, max_tokens=100)  # fmt: skip
    message = reply.choices[0].message
    messages.append(message.as_dict())
    for call in message.tool_calls:
        result = FUNCTIONS[call.name](**json.loads(call.arguments))  # type: ignore[index]
        print(f"tool: {call.name}({call.arguments}) -> {json.dumps(result)}")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    reply = await client.chat(messages, tools=TOOLS, tool_choice="none", temperature=0,
                              max_tokens=80)  # fmt: skip
    print(f"assistant: {reply.choices[0].message.content}")


async def main(args: argparse.Namespace) -> None:
    server = None
    url = args.url
    if url is None:
        server, url = start_server(args.model)
    try:
        async with Client(url) as client:
            if server is not None:
                await wait_until_up(client, server)
            await converse(client, args.question)
    finally:
        if server is not None:
            server.terminate()
            server.wait()


def start_server(model: str | None) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "runtime.cli.main", "serve", "--port", str(port),
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--log-level", "warning"]  # fmt: skip
    if model is not None:
        command += ["--model", model]
    return subprocess.Popen(command, cwd=ROOT), f"http://127.0.0.1:{port}"


async def wait_until_up(client: Client, server: subprocess.Popen[bytes]) -> None:
    with trio.fail_after(300):  # a first run converts the default model (about 10 s)
        while not await client.health():
            if server.poll() is not None:
                raise RuntimeError("the server did not start")
            await trio.sleep(0.2)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="What is the weather in Paris?")
    parser.add_argument("--url", help="a running server (with tools enabled) to ask")
    parser.add_argument("--model", help="the checkpoint to serve (default: SmolLM2)")
    trio.run(main, parser.parse_args())

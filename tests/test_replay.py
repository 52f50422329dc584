"""A dump of real traffic replays as one command: `runtime replay` re-sends every dumped
request to a real server with its timing, and the greedy ones give the dumped outputs; a bad
dump, failed requests and far-apart requests are met with words and an exit status."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from runtime.cli.replay import DumpError, load_dump
from tests.server_process import ServerProcess

GREEDY = {"temperature": 0, "max_tokens": 6}


def replay(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "runtime.cli.main", "replay", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_a_dump_replays(llama_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "dumps"
    key = tmp_path / "key"
    key.write_text("k3y\n")
    server = ServerProcess(
        llama_dir, "--dtype", "float32", "--dump-requests-folder", str(folder),
        "--dump-requests-threshold", "2", "--log-requests", "--log-requests-level", "1",
        "--api-key-file", str(key),
    )  # fmt: skip
    try:
        url = server.url
        requests = [
            ("/v1/completions", {"model": "tiny", "prompt": ["Once", "upon a"], **GREEDY}),
            (
                "/v1/chat/completions",
                {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **GREEDY},
            ),
            (
                "/generate",
                {"text": "A time", "sampling_params": {"temperature": 0, "max_new_tokens": 6}},
            ),
            ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 5, "seed": 3}),
            ("/v1/completions", {"model": "tiny", "prompt": "y", "max_tokens": -1}),  # a 400
        ]
        for path, body in requests:
            httpx.post(url + path, json=body, headers={"Authorization": "Bearer k3y"}, timeout=60)
        replayed = replay(str(folder), "--url", url, "--speed", "20", "--api-key-file", str(key))
    finally:
        server.terminate()
    assert replayed.returncode == 0, replayed.stderr
    out = replayed.stdout
    assert "replayed 4 requests" in out and "completed 4, errors 0" in out, out
    assert "greedy requests with the dumped output: 3 of 3" in out, out
    dumped = [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.open()]
    assert len(dumped) == 8  # the replayed ones were dumped too: the same requests, streamed
    dumped.sort(key=lambda d: d["time"])
    original, replayed = dumped[:4], dumped[4:]
    streamed = ("stream", "stream_options")
    # At 20x the replayed requests are a millisecond apart and arrive in any order: compare them
    # as a multiset.
    assert sorted(_key(d["path"], d["body"]) for d in original) == sorted(
        _key(d["path"], {k: v for k, v in d["body"].items() if k not in streamed}) for d in replayed
    )
    logged = [line for line in server.log.splitlines() if "runtime.requests" in line]
    assert len(logged) >= 4 and all('"params"' in line for line in logged[:4])


def _key(path: str, body: dict[str, object]) -> str:
    return json.dumps([path, body], sort_keys=True)


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a dumped request"),
        ('{"path": "/generate", "body": {}}', "'time' must be a number"),
        ('{"time": 1e999, "path": "/generate", "body": {}}', "'time' must be a number"),
        ('{"time": 2, "path": "/generate", "body": "text"}', "a 'body' object"),
        ('{"time": 2, "path": "/generate", "body": {}, "outputs": [1]}', "'outputs' must"),
    ],
)
def test_a_bad_line_of_the_dump_is_named(tmp_path: Path, line: str, error: str) -> None:
    dump = tmp_path / "dump.jsonl"
    dump.write_text(json.dumps(dumped(1.0)) + "\n" + line + "\n")
    with pytest.raises(DumpError, match=f"{dump}:2: .*{error}"):
        load_dump(dump)


def test_a_bad_dump_or_key_is_one_line_and_status_2(tmp_path: Path) -> None:
    dump = tmp_path / "dump.jsonl"
    dump.write_text(json.dumps(dumped(1.0)) + "\n{not json\n")
    bad_line = replay(str(dump))
    assert bad_line.returncode == 2
    assert bad_line.stderr.startswith(f"runtime replay: error: {dump}:2: not JSON")
    assert len(bad_line.stderr.splitlines()) == 1  # no traceback
    no_key = replay(str(dump), "--api-key-file", str(tmp_path / "missing"))
    assert no_key.returncode == 2 and "--api-key-file" in no_key.stderr
    assert len(no_key.stderr.splitlines()) == 1


def test_failed_requests_exit_1_and_a_far_future_request_waits_at_most_max_wait(
    tmp_path: Path,
) -> None:
    dump = tmp_path / "dump.jsonl"
    lines = [dumped(1.0), dumped(1.0 + 86400 * 365)]  # the second a year later
    dump.write_text("".join(json.dumps(d) + "\n" for d in lines))
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        done = replay(str(dump), "--url", url, "--max-wait", "0.1")
    assert done.returncode == 1, done.stderr
    assert "completed 0, errors 2" in done.stdout
    assert f"for the request of {dump}:2, not the 31536000 s of the dump" in done.stderr
    assert "runtime replay: 2 requests failed" in done.stderr


def dumped(time: float) -> dict[str, object]:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": 0}
    return {"time": time, "path": "/v1/completions", "body": body, "outputs": [{"text": "y"}]}

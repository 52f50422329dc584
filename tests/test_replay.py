"""A dump of real traffic replays as one command: `runtime replay` re-sends every dumped
request to a real server with its timing, and the greedy ones give the dumped outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from tests.server_process import ServerProcess

GREEDY = {"temperature": 0, "max_tokens": 6}


def test_a_dump_replays(llama_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "dumps"
    server = ServerProcess(
        llama_dir, "--dtype", "float32", "--dump-requests-folder", str(folder),
        "--dump-requests-threshold", "2", "--log-requests", "--log-requests-level", "1",
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
            httpx.post(url + path, json=body, timeout=60)
        replay = subprocess.run(
            [sys.executable, "-m", "runtime.cli.main", "replay", str(folder), "--url", url,
             "--speed", "20"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        server.terminate()
    assert replay.returncode == 0, replay.stderr
    out = replay.stdout
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

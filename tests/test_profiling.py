"""start_profile / stop_profile on a real server: each actor writes a Chrome trace, and the
worker's holds the model's own ops."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from api.client import APIStatusError, Client
from tests.server_process import ServerProcess

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


# in either mode the steps run on the worker's torch thread, which the profiler must record
@pytest.fixture(scope="module", params=["process", "inproc"])
def server(
    llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ServerProcess]:
    root = tmp_path_factory.getbasetemp()  # each test's tmp_path is a folder directly in it
    flags = ("--enable-control-api", "--output-root", str(root), "--mode", request.param)
    proc = ServerProcess(llama_dir, *flags)
    yield proc
    proc.terminate()


def events(path: Path) -> list[dict]:
    return list(json.loads(path.read_text())["traceEvents"])


async def test_a_profile_until_stopped(server: ServerProcess, tmp_path: Path) -> None:
    async with Client(server.url) as client:
        await client.start_profile(str(tmp_path), record_shapes=True)
        with pytest.raises(APIStatusError) as again:
            await client.start_profile(str(tmp_path))
        assert again.value.status_code == 400
        await client.generate([5, 6, 7, 8], GREEDY)
        await client.stop_profile()
        with pytest.raises(APIStatusError):
            await client.stop_profile()  # none runs
    names = {e.get("name") for e in events(tmp_path / "worker-rank0.trace.json")}
    # the model's ops: torch's, or our CPU kernels (named by a record_function)
    model_ops = {
        "aten::linear",
        "aten::rms_norm",
        "runtime::fused_add_rms_norm",
        "runtime::paged_decode",
    }
    assert model_ops & names, sorted(n for n in names if n)[:40]
    assert any("mm" in (n or "") or "linear" in (n or "") for n in names)  # the matmuls
    phases = {e["name"] for e in events(tmp_path / "scheduler-rank0.trace.json")}
    assert phases == {"schedule", "wait_for_worker", "update"}
    dispatches = events(tmp_path / "frontend-rank0.trace.json")
    assert {e["name"] for e in dispatches} == {"dispatch"} and len(dispatches) >= 8


async def test_num_steps_stops_by_itself(server: ServerProcess, tmp_path: Path) -> None:
    async with Client(server.url) as client:
        await client.start_profile(str(tmp_path), num_steps=3)
        await client.generate([5, 6, 7, 8], GREEDY)  # 8 steps
        with trio.fail_after(30):
            while not (tmp_path / "worker-rank0.trace.json").exists():  # noqa: ASYNC110
                await trio.sleep(0.05)
        steps = [
            e for e in events(tmp_path / "scheduler-rank0.trace.json") if e["name"] == "schedule"
        ]
        assert len(steps) == 3
        again = tmp_path.with_name(tmp_path.name + "-again")  # traces never overwrite others
        await client.start_profile(str(again))  # the first one is over
        await client.stop_profile()


async def test_a_trace_that_cannot_be_written_stops_nothing(
    server: ServerProcess, tmp_path: Path
) -> None:
    (tmp_path / "frontend-rank0.trace.json").mkdir()  # in the way of the frontend's trace
    async with Client(server.url) as client:
        await client.start_profile(str(tmp_path))
        await client.generate([5, 6, 7, 8], GREEDY)
        with pytest.raises(APIStatusError) as refused:
            await client.stop_profile()
        assert "could not write" in refused.value.message
        assert len((await client.generate([5, 6], GREEDY))["output_ids"]) == 8
    assert (tmp_path / "worker-rank0.trace.json").exists()

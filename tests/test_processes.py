"""Supervision of the actor processes: failures propagate, and no child outlives its parent."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.launch import open_engine
from runtime.processes import ipc_dir
from runtime.processes.supervisor import ActorDiedError
from runtime.protocol import EngineDeadError

PARENT = """
import sys, trio
from runtime.config.engine import EngineConfig
from runtime.frontend.launch import open_engine

async def main():
    config = EngineConfig(model=sys.argv[1], mode="process", tensor_parallel_size=int(sys.argv[2]))
    async with open_engine(config) as engine:
        print(*(p.pid for p in engine.processes.values()), flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


async def wait_for_exit(pid: int) -> None:
    """Wait (without polling) until a process that is not our child has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("tp", [1, 2])  # tensor-parallel rank 1 is a child too
async def test_children_die_when_the_parent_is_sigkilled(llama_dir: Path, tp: int) -> None:
    command = [sys.executable, "-c", PARENT, str(llama_dir), str(tp)]
    parent = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            line += await parent.stdout.receive_some()
        children = [int(pid) for pid in line.split()]
        assert len(children) == 2 + (tp - 1)
        folders = glob.glob(f"{ipc_dir.ROOT}/rt-{parent.pid}-*")
        assert len(folders) == 1
        parent.send_signal(signal.SIGKILL)
        await parent.wait()
        with trio.fail_after(10):
            for pid in children:
                await wait_for_exit(pid)
        # its children remove their sockets' folder as they go (the next start's sweep would)
        assert not await trio.Path(folders[0]).exists()
    finally:
        parent.kill()
        await parent.wait()


async def test_a_dead_worker_fails_its_requests_then_takes_the_engine_down(
    llama_dir: Path,
) -> None:
    errors: list[EngineDeadError] = []
    died = pytest.RaisesExc(ActorDiedError, match="the worker process exited with code -9")
    with pytest.RaisesGroup(died, flatten_subgroups=True):
        async with open_engine(EngineConfig(model=str(llama_dir), mode="process")) as engine:
            try:
                async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=500)):
                    engine.processes["worker"].kill()
            except EngineDeadError as exc:  # told in band, as an HTTP stream reports it
                errors.append(exc)
            with pytest.raises(EngineDeadError):
                await engine.check_health()
    assert len(errors) == 1 and "the worker process exited with code -9" in str(errors[0])


async def test_a_checkpoint_error_in_the_worker_surfaces(tmp_path: Path, llama_dir: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(llama_dir):
        (broken / name).write_bytes((llama_dir / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    died = pytest.RaisesExc(ActorDiedError, match="the worker process exited with code 1")
    with pytest.RaisesGroup(died, flatten_subgroups=True):
        async with open_engine(EngineConfig(model=str(broken), mode="process")):
            pass


def test_python_dash_m_runtime_is_the_runtime_command() -> None:
    """People type `python -m runtime serve` by habit, as they do for vLLM and SGLang."""
    result = subprocess.run(
        [sys.executable, "-m", "runtime", "serve", "--help"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "--max-steps-in-flight" in result.stdout

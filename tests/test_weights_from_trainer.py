"""Weights pushed by a trainer, without a checkpoint on the server's disk: over
torch.distributed from a plain-torch process (gloo on loopback), and as a safetensors body.
A real server in float32; greedy output checked against transformers on the pushed weights."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import torch
import trio
from safetensors import safe_open

from api.client import Client
from runtime.checkpoints.random_model import make_tiny_model
from tests.server_process import ServerProcess
from tests.test_weight_update import generate, reference


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("pushed") / "llama-seed2", "llama", seed=2)


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        llama_dir, "--dtype", "float32", "--enable-control-api", "--allow-weight-cast"
    )
    yield proc
    proc.terminate()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tensor_specs(checkpoint: Path) -> dict[str, list]:
    """What update_weights_from_distributed announces: every tensor, in file order."""
    names, dtypes, shapes = [], [], []
    with safe_open(str(checkpoint), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            tensor = f.get_tensor(name)
            names.append(name)
            dtypes.append(str(tensor.dtype).removeprefix("torch."))
            shapes.append(list(tensor.shape))
    return {"names": names, "dtypes": dtypes, "shapes": shapes}


@contextmanager
def trainer_process(port: int, checkpoint: Path, *flags: str) -> Iterator[subprocess.Popen[str]]:
    """tools/plain_trainer.py, reaped however the test ends."""
    command = [sys.executable, "-m", "tools.plain_trainer", str(port), str(checkpoint), *flags]
    trainer = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield trainer
    finally:
        trainer.kill()
        trainer.wait()


async def test_update_from_a_plain_torch_trainer(
    server: ServerProcess, llama_dir: Path, new_weights: Path
) -> None:
    assert generate(server)["output_ids"] == reference(llama_dir)
    checkpoint = new_weights / "model.safetensors"
    port = free_port()
    with trainer_process(port, checkpoint) as trainer:
        async with Client(server.url) as client:
            joined = await client.init_weights_update_group("127.0.0.1", port, 1, 2, "g")
            assert joined["success"] is True, joined
            again = await client.init_weights_update_group("127.0.0.1", port, 1, 2, "g")
            assert again["success"] is False and "exists" in again["message"]
            done = await client.update_weights_from_distributed(
                **tensor_specs(checkpoint), group_name="g", weight_version="step-1"
            )
            assert done["success"] is True, done
            assert (await client.destroy_weights_update_group("g"))["success"] is True
            gone = await client.destroy_weights_update_group("g")
            assert gone["success"] is False
        assert trainer.wait(timeout=60) == 0
    pushed = generate(server)
    assert pushed["output_ids"] == reference(new_weights)
    assert pushed["meta_info"]["weight_version"] == "step-1"
    async with Client(server.url) as client:
        info = await client.get_model_info()
    assert info["model_path"] == str(llama_dir)  # the checkpoint is still the one on disk


async def test_a_bad_announcement_changes_nothing_and_leaves_the_group(
    server: ServerProcess, llama_dir: Path, new_weights: Path
) -> None:
    await restore(server, llama_dir)
    checkpoint = new_weights / "model.safetensors"
    port = free_port()
    with trainer_process(port, checkpoint, "--hold"):
        async with Client(server.url) as client:
            assert (await client.init_weights_update_group("127.0.0.1", port, 1, 2))["success"]
            specs = tensor_specs(checkpoint)
            specs["shapes"][0] = [1, 2, 3]
            refused = await client.update_weights_from_distributed(**specs)
            assert refused["success"] is False
            assert "shape" in refused["message"] and "init it again" in refused["message"]
            unknown = await client.update_weights_from_distributed(**specs, group_name="nope")
            assert unknown["success"] is False and "init it first" in unknown["message"]
            left = await client.destroy_weights_update_group()
            assert left["success"] is False  # the failed update left it already
    assert generate(server)["output_ids"] == reference(llama_dir)


async def test_a_trainer_that_sends_another_dtype_than_announced_fails_the_update_only(
    server: ServerProcess, llama_dir: Path, new_weights: Path
) -> None:
    """More bytes than announced used to abort the worker inside gloo; fewer, to pass."""
    await restore(server, llama_dir)
    checkpoint = new_weights / "model.safetensors"  # float32
    for announced, sent, word in (("bfloat16", "float32", "more"), ("float32", "bfloat16", "less")):
        port = free_port()
        with trainer_process(port, checkpoint, "--send-as", sent):
            async with Client(server.url) as client:
                assert (await client.init_weights_update_group("127.0.0.1", port, 1, 2))["success"]
                specs = tensor_specs(checkpoint)
                specs["dtypes"] = [announced] * len(specs["names"])
                failed = await client.update_weights_from_distributed(**specs)
                assert failed["success"] is False and f"sent {word} than" in failed["message"]
    assert generate(server)["output_ids"] == reference(llama_dir)


async def test_a_trainer_that_never_joins_holds_nothing_up(server: ServerProcess) -> None:
    """The join waits for the trainer in the worker's background: requests and other steering
    calls go on, and a client that gives up leaves nothing behind that blocks them."""
    port = free_port()  # nobody listens there
    async with Client(server.url) as client:
        with trio.move_on_after(1):
            await client.init_weights_update_group("127.0.0.1", port, 1, 2, "late")
        assert len(generate(server)["output_ids"]) > 0
        await client.pause_generation("keep")
        await client.continue_generation()


async def test_update_from_a_safetensors_body(
    server: ServerProcess, llama_dir: Path, new_weights: Path
) -> None:
    await restore(server, llama_dir)
    with safe_open(str(new_weights / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    async with Client(server.url) as client:
        first = dict(list(tensors.items())[:3])  # a partial update, then the rest
        done = await client.update_weights_from_tensor(safetensors.torch.save(first))
        assert done["success"] is True, done
        rest = safetensors.torch.save(dict(list(tensors.items())[3:]))
        done = await client.update_weights_from_tensor(rest, weight_version="t2")
        assert done["success"] is True, done
        assert generate(server)["output_ids"] == reference(new_weights)

        wrong = {"model.norm.weight": torch.zeros(3)}
        refused = await client.update_weights_from_tensor(safetensors.torch.save(wrong))
        assert refused["success"] is False and "model.norm.weight" in refused["message"]
        garbage = await client.update_weights_from_tensor(b"not a safetensors file")
        assert garbage["success"] is False and "safetensors" in garbage["message"]
    async with httpx.AsyncClient() as http:
        response = await http.post(server.url + "/update_weights_from_tensor", json={"x": 1})
    assert response.status_code == 400 and "pickle" in response.text
    assert generate(server)["output_ids"] == reference(new_weights)


async def restore(server: ServerProcess, llama_dir: Path) -> None:
    async with Client(server.url) as client:
        assert (await client.update_weights_from_disk(str(llama_dir)))["success"]


async def test_an_update_refused_before_the_worker_hears_of_it_leaves_the_group(
    server: ServerProcess, llama_dir: Path, new_weights: Path
) -> None:
    """Else the trainer's broadcasts for it would wait in the group, and the next update
    would install them (found by review)."""
    await restore(server, llama_dir)
    checkpoint = new_weights / "model.safetensors"
    port = free_port()
    with trainer_process(port, checkpoint, "--hold"):
        async with Client(server.url) as client:
            assert (await client.init_weights_update_group("127.0.0.1", port, 1, 2))["success"]
            await client.release_memory_occupation(["weights"])
            refused = await client.update_weights_from_distributed(**tensor_specs(checkpoint))
            assert refused["success"] is False and "was left" in refused["message"]
            await client.resume_memory_occupation(["weights"])
            assert (await client.destroy_weights_update_group())["success"] is False
    assert generate(server)["output_ids"] == reference(llama_dir)


async def test_an_upload_whose_client_leaves_leaves_nothing(server: ServerProcess) -> None:
    """A safetensors body cut off by its client: the temporary file goes, nothing changes,
    and the server serves on."""
    before = generate(server)["output_ids"]
    host, port = server.url.removeprefix("http://").split(":")
    name = "model.norm.weight"  # a big tensor is announced; a part of it comes
    header = json.dumps({name: {"dtype": "F32", "shape": [25 * 10**6], "data_offsets": [0, 10**8]}})
    file_head = len(header).to_bytes(8, "little") + header.encode()
    head = (
        "POST /update_weights_from_tensor HTTP/1.1\r\nHost: x\r\n"
        "Content-Type: application/octet-stream\r\n"
        f"Content-Length: {len(file_head) + 10**8}\r\n\r\n"
    )
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + file_head + b"\0" * 2**20)
        with trio.fail_after(30):
            while not uploads_in_progress():  # noqa: ASYNC110 (the server's files)
                await trio.sleep(0.05)
    with trio.fail_after(30):
        while uploads_in_progress():  # noqa: ASYNC110
            await trio.sleep(0.05)
    assert generate(server)["output_ids"] == before


def uploads_in_progress() -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob("rt-upload-*"))

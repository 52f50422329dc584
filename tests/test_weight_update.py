"""update_weights_from_disk on a real server: float32, greedy, checked against transformers on
the new checkpoint; a checkpoint that does not fit changes nothing."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch
import trio
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from api.client import Client
from runtime.checkpoints.random_model import make_tiny_model
from tests.server_process import ServerProcess

PROMPT = list(range(3, 43))  # 40 tokens: two full blocks of 16 get cached
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("update") / "llama-seed1", "llama", seed=1)


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(llama_dir, "--dtype", "float32", "--enable-control-api")
    yield proc
    proc.terminate()


def reference(model_dir: Path) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([PROMPT])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
    )
    return out[0, len(PROMPT) :].tolist()


def generate(server: ServerProcess) -> dict:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    response = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def update(server: ServerProcess, **body: object) -> httpx.Response:
    return httpx.post(server.url + "/update_weights_from_disk", json=body, timeout=120)


def test_update_from_disk(
    server: ServerProcess, llama_dir: Path, new_weights: Path, model_dirs: dict[str, Path]
) -> None:
    old = generate(server)
    assert old["output_ids"] == reference(llama_dir)

    refused = update(server, model_path=str(model_dirs["qwen2"]))  # another architecture
    assert refused.status_code == 400
    answer = refused.json()
    assert answer["success"] is False and "checkpoint" in answer["message"]
    assert generate(server)["output_ids"] == old["output_ids"]  # the old weights still serve
    missing = update(server, model_path="/nonexistent/checkpoint")
    assert missing.status_code == 400 and missing.json()["success"] is False

    done = update(server, model_path=str(new_weights), weight_version="v2")
    assert done.status_code == 200, done.text
    assert done.json()["success"] is True and done.json()["num_paused_requests"] == 0
    new = generate(server)  # the prompt was cached under the old weights: flushed
    assert new["output_ids"] == reference(new_weights)
    assert new["meta_info"]["weight_version"] == "v2"
    assert new["meta_info"]["cached_tokens"] == 0
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["weight_version"] == "v2" and info["model_path"] == str(new_weights)
    name = "model.layers.1.self_attn.k_proj.weight"  # a slice of our fused qkv_proj
    with safe_open(str(new_weights / "model.safetensors"), framework="pt") as f:
        expected = f.get_tensor(name).flatten()[:10].tolist()
    body = {"name": name, "truncate_size": 10}
    values = httpx.post(server.url + "/get_weights_by_name", json=body, timeout=60).json()
    assert values == pytest.approx(expected)


def test_without_a_flush_the_old_prefix_cache_is_reused(
    server: ServerProcess, llama_dir: Path
) -> None:
    """What `flush_cache: false` means: KV computed under the old weights is served."""
    generate(server)  # caches the prompt under the weights now served
    done = update(server, model_path=str(llama_dir), weight_version="v3", flush_cache=False)
    assert done.status_code == 200, done.text
    stale = generate(server)
    assert stale["meta_info"]["cached_tokens"] == 32  # two blocks of the other weights' KV


async def test_the_trio_client_updates_and_checks_weights(
    server: ServerProcess, llama_dir: Path
) -> None:
    async with Client(server.url) as client:
        refused = await client.update_weights_from_disk("/nonexistent")
        assert refused["success"] is False
        done = await client.update_weights_from_disk(str(llama_dir), weight_version="v9")
        assert done["success"] is True
        assert (await client.get_model_info())["weight_version"] == "v9"
        assert len(await client.get_weights_by_name("model.norm.weight", 4)) == 4
        await client.flush_cache()
        await client.abort_request("no-such-request")


async def test_a_client_that_leaves_midway_does_not_stop_an_update(
    server: ServerProcess, llama_dir: Path
) -> None:
    """The update waits for an open request to finish; its client leaves meanwhile; the
    update still completes, and generation resumes."""
    body = {"model_path": str(llama_dir), "weight_version": "after-leaving"}
    long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:

        async def post(path: str, json: dict) -> None:
            await http.post(path, json=json)

        async def running() -> bool:
            return 'num_requests_running{dp_rank="0"} 1.0' in (await http.get("/metrics")).text

        async def paused() -> bool:
            return bool((await http.get("/is_paused")).json()["is_paused"])

        async def updated() -> bool:
            info = (await http.get("/get_model_info")).json()
            return bool(info["weight_version"] == body["weight_version"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, "/generate", long)
            await until(running)
            with trio.CancelScope() as leaving:
                async with trio.open_nursery() as updating:
                    updating.start_soon(post, "/update_weights_from_disk", body)
                    await until(paused)  # the update has begun, waiting for the request
                    leaving.cancel()  # and its client goes

        async def resumed_with_new_weights() -> bool:  # the version is set before resuming
            return await updated() and not await paused()

        with trio.fail_after(60):
            await until(resumed_with_new_weights)
    assert generate(server)["meta_info"]["weight_version"] == "after-leaving"


async def until(condition: Callable[[], Awaitable[bool]]) -> None:
    """Poll another process's state (no trio.Event of ours can see it)."""
    while not await condition():  # noqa: ASYNC110
        await trio.sleep(0.01)

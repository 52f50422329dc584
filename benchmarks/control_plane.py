"""What steering a live engine costs: pause(abort) under load, weight updates, memory release.

    python -m benchmarks.control_plane [--running 64] [--big-layers 12]

Against `runtime serve --enable-control-api`:
- `pause(abort)` with `--running` streams generating: the time until the pause returns (every
  request ended, its KV free), then `continue_generation`;
- `update_weights_from_disk` of the built-in model, and of a ~100M-parameter Llama checkpoint
  written here with random weights (its own server);
- `update_weights_from_distributed` of the same weights from a plain-torch trainer process
  (`tools/plain_trainer.py`) over loopback gloo, and the bandwidth that makes;
- `release_memory_occupation` / `resume_memory_occupation`: their time, and the worker's RSS
  before, released and resumed.
Prints what the server runs (read back from /get_model_info and /metrics), never its flags.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

from benchmarks.servers import free_port, ours, process_name, process_tree
from runtime.checkpoints.builtin import builtin_model_dir
from runtime.worker.loader import safetensors_files

# safetensors' dtype names -> torch's, as update_weights_from_distributed announces them
DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def worker_rss_mb(server_pid: int) -> float:
    for pid in process_tree(server_pid):
        if process_name(pid) == "worker":
            status = Path(f"/proc/{pid}/status").read_text()
            return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]
    return float("nan")


def timed_post(url: str, path: str, **kwargs: object) -> float:
    started = time.perf_counter()
    response = httpx.post(url + path, timeout=600, **kwargs)  # type: ignore[arg-type]
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{path}: {response.status_code} {response.text}")
    return elapsed


async def running_now(http: httpx.AsyncClient) -> float:
    text = (await http.get("/metrics")).text
    samples = re.findall(r"^runtime:num_requests_running{[^}]*} (\S+)$", text, re.MULTILINE)
    return sum(map(float, samples))  # over data-parallel ranks


async def pause_under_load(url: str, running: int) -> tuple[float, int]:
    """Seconds `pause(abort)` took with `running` streams generating; how many ran."""
    body = {"model": "m", "prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    seen_running = 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:

        async def stream() -> None:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for _ in response.aiter_lines():
                    pass

        async with trio.open_nursery() as nursery:
            for _ in range(running):
                nursery.start_soon(stream)
            while await running_now(http) < running:  # noqa: ASYNC110 (polls /metrics)
                await trio.sleep(0.05)
            await trio.sleep(0.5)  # all of them decoding
            seen_running = int(await running_now(http))
            started = time.perf_counter()
            response = await http.post("/pause_generation", json={"mode": "abort"})
            elapsed = time.perf_counter() - started
            response.raise_for_status()
        await http.post("/continue_generation")
    return elapsed, seen_running


def write_big_checkpoint(out: Path, layers: int) -> tuple[Path, int]:
    """A Llama checkpoint of about 100M parameters (random weights, the built-in tokenizer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    builtin = builtin_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin / name, out / name)
    return out, sum(p.numel() for p in model.parameters())


def distributed_update(url: str, model: str) -> tuple[float, int]:
    """Seconds `update_weights_from_distributed` took to receive and install every tensor of
    the checkpoint from a plain-torch trainer over loopback gloo; the bytes it received."""
    from safetensors import safe_open

    checkpoint = str(safetensors_files(Path(model))[0])  # ours are one file each
    with safe_open(checkpoint, framework="pt") as f:
        tensors = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118
        names = list(tensors)
        dtypes = [DTYPE_NAMES[t.get_dtype()] for t in tensors.values()]
        shapes = [list(t.get_shape()) for t in tensors.values()]
    size = Path(checkpoint).stat().st_size
    port = free_port()
    trainer = subprocess.Popen([sys.executable, "-m", "tools.plain_trainer", str(port), checkpoint])
    try:
        group = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                 "world_size": 2}  # fmt: skip
        timed_post(url, "/init_weights_update_group", json=group)
        specs = {"names": names, "dtypes": dtypes, "shapes": shapes}
        elapsed = timed_post(url, "/update_weights_from_distributed", json=specs)
        timed_post(url, "/destroy_weights_update_group", json={})
        trainer.wait(timeout=60)
    finally:
        trainer.kill()
    return elapsed, size


def figures_for(model: str, label: str, running: int | None) -> None:
    with ours(model, "float32", "m", ["--enable-control-api", "--kv-cache-memory", "256MiB"]) as s:
        info = httpx.get(s.url + "/get_model_info").json()
        print(f"[{label}] model={info['model_path']} max_model_len={info['max_model_len']}")
        if running:
            elapsed, seen = trio.run(pause_under_load, s.url, running)
            print(f"  pause(abort) with {seen} running streams: {elapsed * 1000:.0f} ms")
        update = timed_post(s.url, "/update_weights_from_disk", json={"model_path": model})
        print(f"  update_weights_from_disk: {update:.2f} s")
        seconds, size = distributed_update(s.url, model)
        print(
            f"  update_weights_from_distributed (gloo, loopback): {seconds:.2f} s for "
            f"{size / 2**20:.0f} MiB, {size / 2**20 / seconds:.0f} MiB/s"
        )
        pid = s.process.pid
        before = worker_rss_mb(pid)
        release = timed_post(s.url, "/release_memory_occupation")
        released = worker_rss_mb(pid)
        resume = timed_post(s.url, "/resume_memory_occupation")
        resumed = worker_rss_mb(pid)
        print(
            f"  release_memory_occupation: {release * 1000:.0f} ms, worker RSS {before:.0f} -> "
            f"{released:.0f} MB; resume: {resume:.2f} s, back to {resumed:.0f} MB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--big-layers", type=int, default=15, help="0: skip the big checkpoint")
    args = parser.parse_args()
    figures_for(str(builtin_model_dir()), "built-in model", args.running)
    if args.big_layers:
        with tempfile.TemporaryDirectory() as tmp:
            path, params = write_big_checkpoint(Path(tmp) / "llama-100m", args.big_layers)
            figures_for(str(path), f"{params / 1e6:.0f}M parameters", None)


if __name__ == "__main__":
    main()

"""A reinforcement-learning loop against a live server: rollouts, pause, new weights from the
trainer over torch.distributed, resume, again.

    python examples/rl_loop.py [--model DIR] [--steps 5] [--rollouts 32] [--max-tokens 64]

It starts `runtime serve --enable-control-api` (the built-in model unless `--model`) and a
trainer process that holds the policy's weights (plain torch: no code of ours). Each step:

1. rollouts: `--rollouts` sampled completions at once, through the trio client;
2. `pause_generation` (mode "abort": a real loop would keep the partial rollouts);
3. the trainer "trains" (adds a little noise to every weight) and broadcasts each tensor from
   rank 0 while the server receives them (`update_weights_from_distributed`), tagged with the
   step as `weight_version`;
4. `continue_generation`; one weight is read back to check that the server has the trainer's.

It prints rollout throughput and the pause-to-resume time of each step.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere: the client lives in this repository

from api.client import Client  # noqa: E402
from runtime.checkpoints.builtin import builtin_model_dir  # noqa: E402

CHECKED = "model.norm.weight"  # the weight read back after each update


def trainer(port: int, model_dir: str, steps: Connection) -> None:
    """The trainer: rank 0 of a world of two (itself and the server's worker), plain torch."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        weights |= load_file(file)
    steps.send([(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in
                weights.items()])  # fmt: skip
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0)
    generator = torch.Generator().manual_seed(0)
    while steps.recv() == "step":
        for tensor in weights.values():  # "training": a small step in a random direction
            noise = torch.randn(tensor.shape, generator=generator) * 1e-3
            tensor.add_(noise.to(tensor.dtype))
        for tensor in weights.values():  # in the announced order
            dist.broadcast(tensor, src=0)
        steps.send(weights[CHECKED][:4].float().tolist())
    dist.destroy_process_group()


def start_server(model: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "-m", "runtime.cli.main", "serve", "--model", model, "--port",
               str(port), "--enable-control-api", "--log-level", "warning"]  # fmt: skip
    return subprocess.Popen(command, cwd=ROOT), f"http://127.0.0.1:{port}"


async def wait_until_up(client: Client, server: subprocess.Popen[bytes]) -> None:
    with trio.fail_after(120):
        while not await client.health():
            if server.poll() is not None:
                raise RuntimeError("the server did not start")
            await trio.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def rollouts(client: Client, count: int, max_tokens: int) -> int:
    """`count` sampled completions at once; the tokens they generated."""
    generated = 0

    async def one(i: int) -> None:
        nonlocal generated
        completion = await client.completions(
            prompt=f"Episode {i}:", max_tokens=max_tokens, temperature=1.0, seed=i
        )
        generated += completion.usage.completion_tokens if completion.usage else 0

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)
    return generated


async def loop(
    server: subprocess.Popen[bytes], url: str, port: int, link: Connection, args: argparse.Namespace
) -> None:
    specs = await trio.to_thread.run_sync(link.recv)
    names, dtypes, shapes = (list(column) for column in zip(*specs, strict=True))
    async with Client(url) as client:
        await wait_until_up(client, server)
        async with trio.open_nursery() as nursery:  # the trainer joins meanwhile
            nursery.start_soon(client.init_weights_update_group, "127.0.0.1", port, 1, 2)
        print(f"{'step':>4} {'rollout tok/s':>14} {'pause→resume ms':>16}  weight_version")
        for step in range(1, args.steps + 1):
            started = time.perf_counter()
            tokens = await rollouts(client, args.rollouts, args.max_tokens)
            throughput = tokens / (time.perf_counter() - started)

            paused = time.perf_counter()
            await client.pause_generation("abort")
            link.send("step")  # the trainer steps, then broadcasts while we receive
            answer = await client.update_weights_from_distributed(
                names, dtypes, shapes, weight_version=f"step-{step}"
            )
            await client.continue_generation()
            pause_to_resume = time.perf_counter() - paused
            if not answer["success"]:
                raise RuntimeError(answer["message"])

            expected = await trio.to_thread.run_sync(link.recv)
            served = await client.get_weights_by_name(CHECKED, 4)
            assert all(abs(a - b) < 1e-2 for a, b in zip(served, expected, strict=True))
            version = (await client.get_model_info())["weight_version"]
            print(f"{step:>4} {throughput:>14.0f} {pause_to_resume * 1000:>16.0f}  {version}")
        link.send("stop")
        await client.destroy_weights_update_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(builtin_model_dir()))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    server, url = start_server(args.model)
    port = free_port()
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(
        target=trainer, args=(port, args.model, theirs)
    )
    process.start()
    try:
        trio.run(loop, server, url, port, ours, args)
    finally:
        process.join(timeout=30)
        process.kill()
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()

"""A trainer with no code of ours, for tests and benchmarks: plain torch.distributed, rank 0
of a world with one worker.

    python -m tools.plain_trainer PORT CHECKPOINT.safetensors [--hold | --send-as DTYPE]

Starts the world, then broadcasts every tensor of the checkpoint in file order (cast to
DTYPE with `--send-as`, as a trainer that announced another dtype would; or, with `--hold`,
broadcasts nothing and waits for stdin to close), then leaves.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from safetensors import safe_open


def main() -> None:
    port, checkpoint = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0)
    print("joined", flush=True)
    if "--hold" in sys.argv:
        sys.stdin.read()
    else:
        send_as = sys.argv[sys.argv.index("--send-as") + 1] if "--send-as" in sys.argv else ""
        with safe_open(checkpoint, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = f.get_tensor(name)
                dist.broadcast(tensor.to(getattr(torch, send_as)) if send_as else tensor, src=0)
        print("sent", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

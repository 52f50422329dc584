"""How many bytes the KV pool gets when `--kv-cache-memory` does not say."""

from __future__ import annotations

import torch

CPU_KV_CACHE_MEMORY = 256 * 2**20


def default_kv_cache_memory(
    device: torch.device, gpu_memory_utilization: float, sharers: int = 1, at_least: int = 0
) -> int:
    """256 MiB on CPU, or `at_least` where that is more: what one sequence of the model's
    full length needs (SmolLM2 in float32: 8,192 tokens of 45 KiB, 360 MiB), so that the
    default model serves its whole context without flags. On CUDA, vLLM's rule: this worker
    may fill `gpu_memory_utilization` of the GPU (divided among the `sharers`, data-parallel
    replicas on the same GPU), and the KV pool gets that share less what the worker already
    holds (its weights); the rest of the GPU is for activations, CUDA graphs and the CUDA
    context. It does not depend on what other processes hold at this moment, so replicas
    loading side by side, and tensor-parallel ranks with equal shards, get the same answer."""
    if device.type != "cuda":
        return max(CPU_KV_CACHE_MEMORY, at_least)
    total = torch.cuda.get_device_properties(device).total_memory
    share = int(gpu_memory_utilization * total / sharers)
    held = torch.cuda.memory_allocated(device)
    if share <= held:
        raise ValueError(
            f"no GPU memory is left for the KV cache: this worker holds {held / 2**30:.1f} GiB "
            f"of its {share / 2**30:.1f} GiB share (--gpu-memory-utilization "
            f"{gpu_memory_utilization} of {total / 2**30:.1f} GiB, over {sharers} replica(s)); "
            "raise it, or set --kv-cache-memory"
        )
    return share - held

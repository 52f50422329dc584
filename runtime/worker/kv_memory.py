"""How many bytes the KV pool gets when `--kv-cache-memory` does not say."""

from __future__ import annotations

import torch

CPU_KV_CACHE_MEMORY = 256 * 2**20


def default_kv_cache_memory(device: torch.device, gpu_memory_utilization: float) -> int:
    """256 MiB on CPU. On CUDA, once the weights are loaded, what is left of the GPU's
    `gpu_memory_utilization` share (vLLM's rule; the rest is for activations, CUDA graphs and
    other processes): e.g. 0.9 of an 80 GB GPU holding 16 GB of weights leaves 56 GB."""
    if device.type != "cuda":
        return CPU_KV_CACHE_MEMORY
    free, total = torch.cuda.mem_get_info(device)
    usable = free - int((1.0 - gpu_memory_utilization) * total)
    if usable <= 0:
        raise ValueError(
            f"no GPU memory is left for the KV cache: {free / 2**30:.1f} GiB free of "
            f"{total / 2**30:.1f} GiB, and --gpu-memory-utilization {gpu_memory_utilization} "
            "keeps back the rest; raise it, or set --kv-cache-memory"
        )
    return usable

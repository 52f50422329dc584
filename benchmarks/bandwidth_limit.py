"""compare.py's concurrency-1 line against the weight-bandwidth limit: a decode step of one
sequence reads every weight once, so no system decodes faster than the machine's memory
bandwidth (a STREAM-like copy, measured in the same run right after each concurrency-1 run of
each system: on a shared VM it drifts by tens of percent over minutes) over the bytes of weights
it reads a token. Decode speed here is 1000 / ITL p50 (the prefill is left out).

The bytes a token: a GGUF file's tensors (llama.cpp, and our server where it is given the
file); a float checkpoint's tensors in the served dtype. An untied embedding is left out (a
token reads one row of it); a tied one is the LM head, read whole.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
from pathlib import Path
from typing import Any

import torch

ITEM_BYTES = {"float32": 4, "bfloat16": 2}
UNTIED_EMBEDDINGS = {"token_embd.weight": "output.weight"}  # GGUF's names: embedding -> head


def gguf_bytes(path: str) -> int:
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    return sum(n for name, n in tensors.items() if not _untied(name, tensors))


def checkpoint_bytes(directory: str, dtype: str) -> int:
    """The tensors of a safetensors checkpoint, as `dtype`."""
    shapes: dict[str, list[int]] = {}
    for file in Path(directory).glob("*.safetensors"):
        with file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        shapes |= {k: v["shape"] for k, v in header.items() if k != "__metadata__"}
    numels = {name: int(torch.Size(shape).numel()) for name, shape in shapes.items()}
    untied = {"model.embed_tokens.weight": "lm_head.weight"}
    kept = (n for name, n in numels.items() if not _untied(name, numels, untied))
    return sum(kept) * ITEM_BYTES[dtype]


def _untied(name: str, tensors: dict[str, int], pairs: dict[str, str] = UNTIED_EMBEDDINGS) -> bool:
    return name in pairs and pairs[name] in tensors


def served_bytes(args: argparse.Namespace, system: str) -> int | None:
    """The weight bytes `system` reads a token, or None where it is not known (transformers)."""
    if system == "llama.cpp":
        return gguf_bytes(args.gguf)
    if system in ("vllm", "ours", "before"):
        return checkpoint_bytes(args.model, args.dtype)
    for variant in args.variant:  # our server with other flags: a GGUF file of its own?
        name, _, flags = variant.partition("=")
        words = shlex.split(flags)
        if name == system:
            model = words[words.index("--model") + 1] if "--model" in words else args.model
            return gguf_bytes(model) if model.endswith(".gguf") else None
    return None


def print_bandwidth_limits(
    args: argparse.Namespace, results: dict[str, list[dict[str, Any]]], bandwidth: float
) -> None:
    """Each system's decode speed at concurrency 1 against its limit: the bandwidth (bytes/s)
    measured right after each of its runs (their median), since this machine's drifts by tens
    of percent over minutes; `bandwidth`, measured at the end, where there is none."""
    if 1 not in args.concurrency:
        return
    level = args.concurrency.index(1)
    print(
        f"\nconcurrency 1 against the weight-bandwidth limit (copy at the end "
        f"{bandwidth / 1e9:.1f} GB/s; each system's: after each of its runs, the median)"
    )
    for system, levels in results.items():
        size, itl = served_bytes(args, system), levels[level]["itl_ms"]["p50"]
        if size is None or itl <= 0:
            continue
        copies = levels[level].get("copy_rates") or [bandwidth]
        rate = statistics.median(copies)
        limit_ms = size / rate * 1e3
        print(
            f"  {system:>12}: copy {rate / 1e9:.1f} GB/s "
            f"({', '.join(f'{c / 1e9:.1f}' for c in copies)}); {size / 1e6:.0f} MB a token, "
            f"limit {limit_ms:.2f} ms ({1e3 / limit_ms:.0f} tok/s); decode {itl:.2f} ms "
            f"({1e3 / itl:.0f} tok/s), {itl / limit_ms:.2f}x the limit"
        )

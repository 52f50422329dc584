"""The sharded layers and the sharding loader, rank by rank: two ranks as two threads over
gloo on loopback compute what one unsharded layer computes, each rank loads exactly its
slices of the checkpoint, and a dimension that does not divide is named."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import distributed as dist

from runtime.checkpoints.model_info import load_model_info
from runtime.config.engine import EngineConfig
from runtime.layers.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    Part,
    RowParallelLinear,
    TPGroup,
    TPGroupError,
    VocabParallelEmbedding,
    kv_heads_per_rank,
)
from runtime.models import MODELS
from runtime.models.llama import ModelArgs
from runtime.wire.messages import StopShards
from runtime.worker import tp_group
from runtime.worker.loader import load_weights


def on_two_ranks(body: Callable[[TPGroup], Any]) -> list[Any]:
    """body(group) on ranks 0 and 1, each in its own thread; their results in rank order."""
    store = dist.HashStore()
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            group = tp_group.join(r, 2, store, torch.device("cpu"))
            try:
                results[r] = body(group)
            finally:
                tp_group.leave(group)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]
    return results


def test_sharded_layers_compute_what_one_whole_layer_computes() -> None:
    torch.manual_seed(0)
    x, ids = torch.randn(5, 8), torch.tensor([0, 3, 5, 7, 2])
    weight, bias, table = torch.randn(6, 8), torch.randn(6), torch.randn(8, 8)

    def body(tp: TPGroup) -> tuple[torch.Tensor, ...]:
        row = RowParallelLinear(8, 6, True, tp)
        embed = VocabParallelEmbedding(8, 8, tp)
        head = ParallelLMHead(8, 8, tp)
        column = ColumnParallelLinear(8, [Part.split(6, tp, "rows")], False)
        with torch.no_grad():
            loads = [(row, weight, None), (embed, table, None), (head, table, None)]
            for layer, full, part in [*loads, (column, weight, 0)]:
                slot = layer.slot("weight", part)
                slot.dest.copy_(slot.take(full))
            row.bias.copy_(bias)
            logits = head.logits(x)
            half = x[:, tp.rank * 4 : (tp.rank + 1) * 4]
            return row(half), embed(ids), column(x), logits  # type: ignore[return-value]

    first, second = on_two_ranks(body)
    expected_row = x @ weight.T + bias
    for rank in (first, second):
        torch.testing.assert_close(rank[0], expected_row)
        torch.testing.assert_close(rank[1], table[ids])
    torch.testing.assert_close(torch.cat([first[2], second[2]], dim=-1), x @ weight.T)
    torch.testing.assert_close(first[3], x @ table.T)
    assert second[3] is None  # only rank 0 gets the logits


def test_messages_reach_the_other_rank_as_bytes() -> None:
    def body(tp: TPGroup) -> object:
        if tp.rank == 0:
            tp_group.send_message(tp, StopShards())
            return None
        return tp_group.receive_message(tp)

    assert on_two_ranks(body)[1] == StopShards()


def test_a_collective_that_times_out_fails_with_a_clear_error() -> None:
    def body(tp: TPGroup) -> object:
        if tp.rank == 1:
            return None  # never takes part
        tp.timeout = timedelta(seconds=0.2)
        with pytest.raises(TPGroupError, match="tensor-parallel rank 0: a collective failed"):
            tp.all_reduce_(torch.zeros(1))
        return "raised"

    assert on_two_ranks(body)[0] == "raised"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: one KV head, replicated
def test_each_rank_loads_exactly_its_slices(model_dirs: dict[str, Path], arch: str) -> None:
    config = EngineConfig(model=str(model_dirs[arch]), dtype="float32")
    info = load_model_info(config)
    args = ModelArgs.from_hf(info.hf_config, info.architecture)

    def build(tp: TPGroup) -> dict[str, torch.Tensor]:
        model = MODELS[info.architecture](args, info.hf_config, 64, tp)
        load_weights(model, model_dirs[arch])
        return dict(model.named_parameters())

    whole = build(TPGroup())
    ranks = [build(TPGroup(rank, 2)) for rank in range(2)]  # loading needs no collectives
    d, heads = args.head_dim, args.num_heads
    for name, full in whole.items():
        shards = [rank[name] for rank in ranks]
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            q, kv = heads * d, args.num_kv_heads * d
            k, v = full[q : q + kv], full[q + kv :]
            for r, shard in enumerate(shards):
                q_part = full[r * q // 2 : (r + 1) * q // 2]
                if args.num_kv_heads >= 2:
                    k_part, v_part = (t[r * kv // 2 : (r + 1) * kv // 2] for t in (k, v))
                else:  # the one KV head, on both ranks
                    k_part, v_part = k, v
                torch.testing.assert_close(shard, torch.cat([q_part, k_part, v_part]))
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.testing.assert_close(torch.cat(shards, dim=1), full)
        elif name.endswith(("gate_up_proj.weight", "embed_tokens.weight", "lm_head.weight")):
            if "gate_up" in name:  # each rank: its gate rows, then its up rows
                gate, up = full.chunk(2)
                full = torch.cat([gate.chunk(2)[0], up.chunk(2)[0], gate.chunk(2)[1],
                                  up.chunk(2)[1]])  # fmt: skip
            torch.testing.assert_close(torch.cat(shards), full)
        else:  # norms: whole on every rank
            for shard in shards:
                torch.testing.assert_close(shard, full)


def test_a_dimension_that_does_not_divide_is_named(model_dirs: dict[str, Path]) -> None:
    config = EngineConfig(model=str(model_dirs["qwen2"]), dtype="float32")
    info = load_model_info(config)
    args = ModelArgs.from_hf(info.hf_config, info.architecture)
    assert args.num_heads == 6
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) is not divisible by "
                       r"--tensor-parallel-size 4"):  # fmt: skip
        MODELS[info.architecture](args, info.hf_config, 64, TPGroup(0, 4))
    assert kv_heads_per_rank(8, 4) == 2 and kv_heads_per_rank(2, 4) == 1
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3 is neither a divisor nor a "
                       r"multiple of num_key_value_heads \(2\)"):  # fmt: skip
        kv_heads_per_rank(2, 3)

"""The scheduler's core with embeddings: prefills whose last chunk brings a vector instead of
a token (the property test in test_scheduler.py interleaves them with everything else)."""

from __future__ import annotations

import pytest

from runtime.config.pooling import PoolingParams
from tests.core_harness import CoreHarness


@pytest.mark.parametrize("depth", [1, 2])
def test_an_embedding_is_a_prefill_that_frees_its_blocks_at_once(depth: int) -> None:
    h = CoreHarness(max_num_batched_tokens=8, max_model_len=30, depth=depth)
    prompt = list(range(3, 33))  # fills the context: no room for a token, none is needed
    h.add("e", prompt, 1, pooling=PoolingParams("mean"))
    h.add("g", [5, 6], 3)
    steps = 0
    while not h.pipeline.idle:
        h.step()
        steps += 1
    (out,) = h.outputs["e"]
    assert (out.token_id, out.finish_reason, out.embedding) == (-1, "stop", bytes(prompt[:4]))
    assert len(h.outputs["g"]) == 3 and steps >= 30 // 8  # chunked, beside the generation
    assert h.bm.num_free_blocks == h.bm.num_blocks
    assert (h.sched.num_embeddings, h.sched.num_embedding_tokens) == (1, 30)


def test_only_last_pooling_reads_the_prefix_cache() -> None:
    h = CoreHarness(max_model_len=64)
    prompt = [7] * 13
    h.add("warm", prompt, 2)
    h.run_until_idle()
    for rid, kind in (("last", "last"), ("mean", "mean"), ("cls", "cls")):
        h.add(rid, prompt, 1, pooling=PoolingParams(kind))
        h.run_until_idle()
    cached = {rid: h.outputs[rid][0].num_cached_tokens for rid in ("last", "mean", "cls")}
    assert cached == {"last": 12, "mean": 0, "cls": 0}  # blocks of 4, the last token computed

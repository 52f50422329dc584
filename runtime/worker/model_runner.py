"""Turns a `StepPlan` into one batched forward pass and one batched sampling call.

Holds the model, the KV cache tensor and the worker's mirror of the sequences. Synchronous: the
worker actor runs `execute` in a thread of its own.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from runtime.checkpoints.model_info import load_model_info, resolve_max_model_len
from runtime.config.engine import EngineConfig
from runtime.kernels.select import select_kernels
from runtime.layers.basic import Linear
from runtime.layers.parallel import SINGLE, TPGroup, kv_heads_per_rank
from runtime.models.llama import LlamaForCausalLM, ModelArgs
from runtime.wire.messages import Logprobs, ShardStep, StepPlan
from runtime.worker.batch_inputs import InputBuilder, ModelInputs
from runtime.worker.decode_graphs import DecodeGraphs
from runtime.worker.grammar_masks import GrammarMasks, MaskJob
from runtime.worker.huge_pages import huge_zeros
from runtime.worker.kv_memory import default_kv_cache_memory
from runtime.worker.logits_processors import LogitsProcessors
from runtime.worker.logprobs import PromptLogprobs, top_logprobs
from runtime.worker.pooling import Pooler
from runtime.worker.quantization import describe, plan_for
from runtime.worker.sampler import SamplingBatch, choose, draw, sample
from runtime.worker.seq_table import SeqTable, WorkerSeq
from runtime.worker.served_weights import ModelShape, ServedWeights
from runtime.worker.tp_group import send_message


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What one step sampled (one entry per sequence that sampled), and where its time went.
    On CUDA nothing waits for the GPU until the sampled ids are read: forward_seconds is the
    time to queue the forward, and the GPU's time shows in sample_seconds."""

    seq_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    prepare_seconds: float
    forward_seconds: float
    sample_seconds: float
    top: tuple[Logprobs | None, ...] = ()  # by seq_ids, when some sequence asked
    prompt: tuple[Logprobs | None, ...] = ()
    pooled_seq_ids: tuple[int, ...] = ()  # embeddings whose prompt this step finished
    pooled: tuple[bytes, ...] = ()  # their vectors, by pooled_seq_ids


# Below this many parameters per worker, leave one core to the schedulers and the frontend.
# Measured on the 2-core dev box (benchmarks/compare.py --variant): the built-in model (5M)
# served 1.2-1.5x more tokens/s with one worker thread than with two, because its frontend
# needs about as much CPU as its worker; llama-80m (82M) served 1.13-1.17x more with two,
# its steps being bound by memory bandwidth, which a second core doubles.
SMALL_MODEL_PARAMETERS = 20_000_000


def default_num_threads(num_workers: int = 1, parameters: int = 0) -> int:
    """The cores, less one for the frontend unless the model is large, shared by the
    workers (`parameters`: of this worker's share of the model)."""
    spare = 1 if parameters < SMALL_MODEL_PARAMETERS else 0
    return max(1, (len(os.sched_getaffinity(0)) - spare) // num_workers)


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every linear layer's, the LM head's (with tied
    embeddings, the embedding's matrix), each matrix once; an embedding only gathers rows."""
    seen: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            w = module.weight
            seen[w.data_ptr()] = w.numel() * w.element_size()
    return sum(seen.values())


class ModelRunner:
    """One tensor-parallel rank's share of the model (all of it without tensor parallelism).
    Rank 0 samples and tells the other ranks each step (`ShardStep`); they `follow` it."""

    def __init__(
        self,
        config: EngineConfig,
        progress: bool = False,
        tp: TPGroup = SINGLE,
        device: torch.device | None = None,
    ) -> None:
        self.config = config
        self.tp = tp
        self.info = load_model_info(config)
        self.max_model_len = resolve_max_model_len(config, self.info)
        self.device = device or torch.device(config.device)
        self.block_size = config.block_size
        args = self.args = ModelArgs.from_hf(self.info.hf_config, self.info.architecture)
        self.kernels = select_kernels(config.attention_backend, self.device, self.info.dtype)
        self.attention_backend = "torch" if self.kernels is None else self.kernels.name
        self.quant_plan = plan_for(config.quantization, config.model)
        shape = ModelShape(
            self.info, args, self.max_model_len, tp, self.device, self.kernels, self.quant_plan
        )
        self.weights = ServedWeights(shape, config.model, progress, config.allow_weight_cast)
        assert self.weights.model is not None
        self.quantization = describe(self.weights.model, self.quant_plan)
        self.step_weight_bytes = step_weight_bytes(self.weights.model)
        workers = config.data_parallel_size * config.tensor_parallel_size
        parameters = sum(p.numel() for p in self.weights.model.parameters())
        torch.set_num_threads(config.num_threads or default_num_threads(workers, parameters))
        self.num_threads = torch.get_num_threads()
        self.num_kv_heads = kv_heads_per_rank(args.num_kv_heads, tp.size)  # this rank's
        self.num_blocks = self._num_kv_blocks()
        # what rank 0 sampled in its latest step, for the other ranks' tables
        self._sampled: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        # [layer, K/V, kv_head, block, offset, head_dim]: see runtime/layers/attention.py
        cache_shape = (
            args.num_layers,
            2,
            self.num_kv_heads,
            self.num_blocks,
            self.block_size,
            args.head_dim,
        )
        self.cache_shape = cache_shape
        self.kv_caches = self._new_kv_caches()
        self.table = SeqTable()
        self.processors = LogitsProcessors(
            self.info.vocab_size, self.info.eos_token_ids, self.device
        )
        self.grammars = GrammarMasks(config.model, self.info.vocab_size, self.info.eos_token_ids)
        self.prompt_logprobs = PromptLogprobs()
        self.pooler = Pooler()
        self.inputs = InputBuilder(
            self.device,
            config.block_size,
            self.num_kv_heads,
            self.num_blocks,
            self.info,
            self.prompt_logprobs,
            self.kernels,
        )
        self.processed_logprobs = config.logprobs_mode == "processed"
        self.decode_graphs: DecodeGraphs | None = None
        self._graphs()  # captured at startup, not by the first request

    def _graphs(self) -> DecodeGraphs | None:
        """The decode step's CUDA graphs, recaptured once the weights or the KV pool they
        were recorded with are replaced; None where they do not apply."""
        kernels, model, graphs = self.kernels, self.weights.model, self.decode_graphs
        if not (
            self.device.type == "cuda"
            and kernels is not None
            and kernels.name == "triton"
            and self.tp.size == 1
            and not self.config.enforce_eager
            and model is not None
            and self.kv_caches.numel() > 0
        ):
            graphs = None
        elif graphs is None or not graphs.records(model, self.kv_caches):
            self.decode_graphs = graphs = None  # free the old ones before the new ones capture
            width = -(-self.max_model_len // self.block_size)
            graphs = DecodeGraphs(model, self.kv_caches, kernels, self.config.max_num_seqs, width)
            graphs.capture()
        self.decode_graphs = graphs
        return graphs

    def _new_kv_caches(self) -> torch.Tensor:
        if self.device.type == "cpu":  # a decode step reads every sequence's whole context
            return huge_zeros(self.cache_shape, self.info.dtype)
        return torch.zeros(self.cache_shape, dtype=self.info.dtype, device=self.device)

    def release_memory(self, tags: tuple[str, ...]) -> None:
        """Give the KV pool and/or the weights back to the system (a colocated trainer
        wants them); nothing may run until `resume_memory` brings them back."""
        if "kv_cache" in tags:
            self.kv_caches = torch.empty(0, dtype=self.info.dtype, device=self.device)
        if "weights" in tags:
            self.weights.release()
        self.decode_graphs = None  # they hold the weights, the KV pool and their own memory
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self, tags: tuple[str, ...]) -> str:
        """Bring back what `release_memory` freed: a zeroed KV pool, the weights reloaded from
        where they last came from. Returns "" or what went wrong."""
        if "weights" in tags:
            error = self.weights.resume()
            if error:  # e.g. the checkpoint is gone: the worker carries on
                return error
        if "kv_cache" in tags and self.kv_caches.numel() == 0:
            self.kv_caches = self._new_kv_caches()
        return ""

    def _num_kv_blocks(self) -> int:
        per_block = self.info.kv_bytes_per_block(self.block_size, self.num_kv_heads)
        needed = -(-self.max_model_len // self.block_size) * per_block
        memory = self.config.kv_cache_memory or default_kv_cache_memory(
            self.device,
            self.config.gpu_memory_utilization,
            self.config.data_parallel_size,
            at_least=needed,
        )
        blocks = self.config.num_kv_blocks or memory // per_block
        if blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {blocks * self.block_size} tokens ({blocks} blocks of "
                f"{per_block} bytes), fewer than max_model_len={self.max_model_len}: raise "
                f"--kv-cache-memory to at least {needed} bytes or lower --max-model-len"
            )
        return blocks

    @property
    def dtype(self) -> str:
        return str(self.info.dtype).removeprefix("torch.")

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutcome:
        """Run one step: apply the plan to the sequence table, compute, sample."""
        start = time.perf_counter()
        seqs = self._apply(plan)
        inputs = self.inputs.build(plan, seqs)
        if self.tp.size > 1:
            rows = tuple(inputs.logit_rows.tolist())
            send_message(self.tp, ShardStep(plan, *self._sampled, rows))
        seq_ids = [plan.seq_ids[i] for i in inputs.sampled]
        sampled_seqs = [seqs[i] for i in inputs.sampled]
        masks = self.grammars.start(seq_ids, sampled_seqs)  # made while the forward runs
        prepared = time.perf_counter()
        logits, pooled = self._forward(inputs)
        forwarded = time.perf_counter()
        num_sampled = len(inputs.sampled)
        if inputs.prompt_rows:
            self.prompt_logprobs.add(logits[num_sampled:], inputs.prompt_rows)
        token_ids: list[int] = []
        logprobs: list[float] = []
        top: tuple[Logprobs | None, ...] = ()
        prompt: tuple[Logprobs | None, ...] = ()
        if inputs.sampling is not None:
            token_ids, logprobs, top = self._sample(
                logits[:num_sampled], inputs.sampling, seq_ids, sampled_seqs, masks
            )
            if self.prompt_logprobs.waiting:
                prompt = self._first_samples(seq_ids, sampled_seqs)
        sampled_at = dict(zip(inputs.sampled, token_ids, strict=True))
        for i, (seq, n) in enumerate(zip(seqs, plan.num_tokens, strict=True)):
            SeqTable.commit(seq, n, sampled_at.get(i))
        sampled_ids = tuple(plan.seq_ids[i] for i in inputs.sampled)
        self._sampled = (sampled_ids, tuple(token_ids))
        done = time.perf_counter()
        return StepOutcome(
            seq_ids=sampled_ids,
            token_ids=tuple(token_ids),
            logprobs=tuple(logprobs),
            prepare_seconds=prepared - start,
            forward_seconds=forwarded - prepared,
            sample_seconds=done - forwarded,
            top=top,
            prompt=prompt,
            pooled_seq_ids=pooled[0],
            pooled=pooled[1],
        )

    def _forward(
        self, inputs: ModelInputs
    ) -> tuple[torch.Tensor, tuple[tuple[int, ...], tuple[bytes, ...]]]:
        """The logits of the rows that sample or score, and the vectors of the embedding
        sequences this step finishes (by seq id)."""
        model = self.weights.model
        assert model is not None, "a step while the weights are released"
        if inputs.pool_slices:  # the final norm of the pooled rows too; the same collectives
            assert isinstance(model, LlamaForCausalLM)
            x, residual = model.hidden_states(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta
            )
            logits = model.logits(x, residual, inputs.logit_rows, inputs.meta)
            hidden = model.final_norm(x, residual, inputs.pool_rows, inputs.meta)
            pooled = self.pooler.add(hidden, inputs.pool_slices)
        else:
            graphs = self._graphs()
            scores_prompts = bool(inputs.prompt_rows)
            if graphs is not None and graphs.fits(inputs.meta, len(inputs.sampled), scores_prompts):
                logits = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
            else:
                logits = model(
                    inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                    inputs.logit_rows,
                )  # fmt: skip
            pooled = ((), ())
        assert logits is not None, "tensor-parallel rank 0 gets the logits"
        return logits, pooled

    @torch.inference_mode()
    def follow(self, step: ShardStep) -> None:
        """A rank other than 0: the same step as rank 0, on this rank's share of the model
        (its table learns the tokens rank 0 sampled last; it samples nothing itself)."""
        for seq_id, token_id in zip(step.sampled_seq_ids, step.sampled_token_ids, strict=True):
            self.table.seqs[seq_id].token_ids.append(token_id)
        seqs = self.table.apply(step.plan)
        inputs = self.inputs.build(step.plan, seqs)
        rows = torch.tensor(step.logit_rows, dtype=torch.long, device=self.device)
        model = self.weights.model
        assert model is not None, "a step while the weights are released"
        model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, rows)
        for seq, n in zip(seqs, step.plan.num_tokens, strict=True):
            SeqTable.commit(seq, n, None)

    def _apply(self, plan: StepPlan) -> list[WorkerSeq]:
        """The table brought up to date, and the per-sequence state of what requests asked."""
        for seq_id in plan.released:
            self.processors.leave(seq_id)
            self.prompt_logprobs.leave(seq_id)
            self.grammars.leave(seq_id)
            self.pooler.leave(seq_id)
        seqs = self.table.apply(plan)
        for new in plan.new_seqs:
            seq = self.table.seqs[new.seq_id]
            self.processors.arrive(new.seq_id, seq)
            self.prompt_logprobs.arrive(new.seq_id, seq)
            self.grammars.arrive(new.seq_id, seq)
        return seqs

    def _greedy_past_bans(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        seq_ids: list[int],
        seqs: list[WorkerSeq],
    ) -> tuple[list[int], list[float], tuple[Logprobs | None, ...]] | None:
        """Greedy rows whose processors only ban tokens (min_tokens: the stops), where no row's
        argmax is banned: banning lowers no row's maximum, so the plain path's one pass picks
        what processing would (and the raw log-probabilities are what it reports). None: take
        the general path."""
        if not batch.all_greedy or self.kernels is None or not logits.is_contiguous():
            return None
        if not self.processors.only_bans(seqs):
            return None
        tokens, token_logprobs = self.kernels.greedy(logits)
        picked = tokens.tolist()
        if self.processors.bans_any(seq_ids, seqs, picked):
            return None
        return picked, token_logprobs.tolist(), ()

    def _sample(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        seq_ids: list[int],
        seqs: list[WorkerSeq],
        masks: MaskJob | None = None,
    ) -> tuple[list[int], list[float], tuple[Logprobs | None, ...]]:
        """Token ids, their log-probabilities, and the top ones where asked."""
        if masks is not None:
            # first: the raw log-probabilities are of the constrained distribution, as vLLM
            # reports them; a -inf stays -inf through penalties and bias, so this is the same
            # as masking after them
            self.grammars.apply(logits, masks)
        asking = self.processors.asking
        if not self.processed_logprobs and (not asking or asking.isdisjoint(seq_ids)):
            tokens, token_logprobs = sample(logits, batch, self.kernels)  # the plain path
            return tokens.tolist(), token_logprobs.tolist(), ()
        params = [seq.params for seq in seqs]
        processes = any(p.processes_logits for p in params)
        wants_top = any(p.logprobs for p in params)
        if masks is None and not wants_top and not self.processed_logprobs:
            picked = self._greedy_past_bans(logits, batch, seq_ids, seqs)
            if picked is not None:
                return picked
        raw = None if self.processed_logprobs else torch.log_softmax(logits, dim=-1)
        if processes:
            self.processors.apply(logits, seq_ids, seqs)
        if masks is not None:
            self.grammars.keep_one(logits, masks)
        if self.processed_logprobs:
            tokens, processed = choose(logits, batch, processed=True)
        else:
            tokens, processed = draw(logits, batch, self.kernels), None
        if processes:
            self.processors.record(seq_ids, seqs, tokens)
        source = processed if raw is None else raw
        assert source is not None
        token_logprobs = source.gather(-1, tokens[:, None]).squeeze(-1)
        top: tuple[Logprobs | None, ...] = ()
        if wants_top:
            positions = [len(seq.token_ids) for seq in seqs]
            top = top_logprobs(source, [p.logprobs for p in params], positions)
        return tokens.tolist(), token_logprobs.tolist(), top

    def _first_samples(
        self, seq_ids: list[int], seqs: list[WorkerSeq]
    ) -> tuple[Logprobs | None, ...]:
        """The prompt log-probabilities of sequences sampling their first token now."""
        prompt = [
            self.prompt_logprobs.take(s) if seq.num_output_tokens == 0 else None
            for s, seq in zip(seq_ids, seqs, strict=True)
        ]
        return tuple(prompt) if any(p is not None for p in prompt) else ()

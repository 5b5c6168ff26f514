"""The model worker: model, KV tensors, device seq_lens, sampling.

The descriptor loop it runs (apply, plan, seq_lens sync, forward, reply) is worker_loop.py;
this class supplies the forward, the sampling and the tensor-parallel group.

With --tp-size N every rank runs this same loop on the same descriptors, in lockstep: each
rank that accepts a descriptor meets the others in a step-id check before the forward
(so no rank computes a step its peers did not), the model's collectives keep the ranks
together inside the forward, and rank 0's sampled tokens are broadcast (parallel.py).
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import psutil
import torch

from gpu_worker.kernels.cpu_kernels import load_decode_attention as load_decode_kernel
from gpu_worker.kernels.cpu_kernels import (
    load_elementwise_kernels,
    load_greedy_argmax,
    load_quant_linear,
    load_widening_bf16_linear,
    require_kernels,
    wants_decode_kernel,
)
from gpu_worker.kernels.triton import load_triton_kernels
from gpu_worker.layers.gguf_layers import weights_left_uninitialised
from gpu_worker.layers.linear_plan import choose_experts, choose_linear
from gpu_worker.model.compiled_decode import wants_compile, warm_up
from gpu_worker.model.decoder import LlamaForCausalLM
from gpu_worker.model.model_config import ModelConfig
from gpu_worker.model.weights import iter_weights, load_config
from gpu_worker.runtime.batch_invariance import batch_invariance_off_because
from gpu_worker.runtime.batch_state import BatchState, StepPlan
from gpu_worker.runtime.decode_graphs import DecodeGraphs
from gpu_worker.runtime.grammar import GrammarTable
from gpu_worker.runtime.kv_pool import KVPool, kv_bytes_per_token
from gpu_worker.runtime.malloc_policy import release_freed_memory
from gpu_worker.runtime.ngram_drafter import NgramDrafter
from gpu_worker.runtime.parallel import ShardPlan, TPGroup, dist_address
from gpu_worker.runtime.pooling import Pooler
from gpu_worker.runtime.prompt_logprobs import score_prompt_chunks
from gpu_worker.runtime.sampler import SamplingTable, sample
from gpu_worker.runtime.worker_loop import WorkerLoop
from trident.wire.backend import BatchDescriptor
from trident.wire.child import ChildContext
from trident.wire.cluster import layout_of
from trident.wire.logprobs import PromptLogprobs
from trident.wire.server_args import ServerArgs

logger = logging.getLogger(__name__)
MIN_COLLECTIVE_TIMEOUT_S = 30.0


def resolve_dtype(args: ServerArgs, device: torch.device) -> torch.dtype:
    """`--dtype auto`: bf16 on CUDA; on CPU, bf16 where its matmuls are fast: AVX-512 (oneDNN,
    and our VNNI kernel with AVX512-BF16), or AVX2 with our widening kernel, which runs the
    linear layers only when left to choose (`--linear-weights auto`, no int8). Else float32."""
    if args.dtype != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    if device.type == "cuda" or "AVX512" in torch.backends.cpu.get_cpu_capability():
        return torch.bfloat16
    widening = args.linear_weights == "auto" and args.weight_dtype != "int8" and load_widening_bf16_linear() is not None
    return torch.bfloat16 if widening else torch.float32


def resolve_weight_dtype(args: ServerArgs, device: torch.device, dtype: torch.dtype) -> str:
    """`--weight-dtype auto`: a GGUF's own formats on CPU in bf16 where our quantized kernels
    run (they read about the file's bytes a token where bf16 reads 2 a weight, which makes
    them faster and smaller: docs/benchmarks.md), else bf16, the weights dequantized into --dtype; --dtype float32 stays
    the exact path the parity tests use."""
    gguf_input = args.model_path.endswith(".gguf")
    if args.weight_dtype == "gguf":
        if not gguf_input:
            raise ValueError(f"--weight-dtype gguf serves a .gguf file's own formats; {args.model_path} is not one")
        if device.type != "cpu":
            raise ValueError("--weight-dtype gguf runs on --device cpu (csrc/quant_linear.cpp)")
        return "gguf"
    if args.weight_dtype != "auto":
        return args.weight_dtype
    quantized_kernels = device.type == "cpu" and args.linear_weights == "auto" and load_quant_linear() != ""
    return "gguf" if gguf_input and dtype == torch.bfloat16 and quantized_kernels else "bf16"


def resolve_attention_backend(args: ServerArgs, device: torch.device) -> str:
    """`--attention-backend auto`: triton on CUDA, torch elsewhere. The triton backend has its
    own decode attention, so a `--decode-attention` other than auto beside it is a mistake."""
    backend = args.attention_backend
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and args.decode_attention != "auto":
        raise ValueError(
            f"--decode-attention {args.decode_attention} picks the CPU decode attention of "
            "--attention-backend torch; the triton backend runs its own"
        )
    return backend


def kv_pool_tokens(
    args: ServerArgs, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, num_kv_heads: int
) -> int:
    """Tokens of KV this rank can hold (its own KV heads only)."""
    if args.max_total_tokens > 0:
        return args.max_total_tokens
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = psutil.virtual_memory().available
        free //= args.dp_size * layout_of(args).ranks_per_node  # the workers of this node share its memory
    return max(args.page_size * 16, int(free * args.mem_fraction) // kv_bytes_per_token(cfg, dtype, num_kv_heads))


def worker_device(args: ServerArgs, rank: int, dp_rank: int) -> torch.device:
    """Each worker on a node has a GPU of its own, counted from --base-gpu-id."""
    if args.device == "cuda":
        layout = layout_of(args)
        # Ray gives each rank's actor a GPU of its own (CUDA_VISIBLE_DEVICES), which the worker inherits.
        local_index = dp_rank * layout.ranks_per_node + rank - layout.local_ranks().start
        if layout.ranks_anywhere:
            local_index = 0
        device = torch.device(f"cuda:{args.base_gpu_id + local_index}")
        torch.cuda.set_device(device)
        return device
    return torch.device(args.device)


def cpu_threads_per_worker(args: ServerArgs) -> int:
    """--cpu-threads, or the CPUs this process may run on shared among the node's workers
    (os.cpu_count() would count the host's, past a taskset or a container's limit)."""
    if args.cpu_threads > 0:
        return args.cpu_threads
    workers_here = args.dp_size * layout_of(args).ranks_per_node
    return max(1, len(os.sched_getaffinity(0)) // workers_here)


class Worker(WorkerLoop):
    def __init__(self, ctx: ChildContext) -> None:
        super().__init__(ctx)
        args = ctx.args
        self.place_on_device(ctx)
        started = time.monotonic()
        self.build_model(args)
        invariance_off_because = self.choose_and_apply_linear(args)
        release_freed_memory()
        logger.info(
            "loaded %s in %.1f s (%s, weights %s, %s)",
            args.model_path,
            time.monotonic() - started,
            self.dtype,
            self.weight_dtype,
            self.device,
        )
        self.allocate_kv_and_kernels(args, invariance_off_because)
        self.build_batch_state(args)
        self.build_decode_graphs(args)
        self.open_sockets(ctx)

    def place_on_device(self, ctx: ChildContext) -> None:
        """Step 1: this rank's device, threads and dtype; the model's config and context
        length; its shard of the model (`ShardPlan`) and the tensor-parallel group it joins."""
        args = ctx.args
        self.device = worker_device(args, ctx.rank, ctx.dp_rank)
        require_kernels(args.decode_attention != "torch")
        if self.device.type == "cpu":
            torch.set_num_threads(cpu_threads_per_worker(args))
        self.dtype = resolve_dtype(args, self.device)
        self.cfg = load_config(args.model_path)
        self.vocab_size = self.cfg.vocab_size
        self.eos_token_ids = list(self.cfg.eos_token_ids)
        self.context_length = min(args.context_length or self.cfg.max_position, self.cfg.max_position)
        # Checked before joining the group, so that a bad --tp-size is a clear start-up error on every rank.
        self.plan = ShardPlan.build(self.cfg, ctx.rank, args.tp_size)
        # A collective that waits longer than this raises, and the rank exits (a peer died or
        # desynchronised); normally the supervisor or the scheduler's watchdog restarts the group first.
        timeout_s = max(MIN_COLLECTIVE_TIMEOUT_S, args.watchdog_timeout_s)
        host, port = dist_address(args.dist_init_host)
        self.tp = TPGroup.init(ctx.rank, args.tp_size, self.device, port, timeout_s, host)
        if args.tp_size > 1:
            logger.info("%s", self.plan.describe())

    def build_model(self, args: ServerArgs) -> None:
        """Step 2: the weights' format (`--weight-dtype`) and the model with its weights
        loaded (`load_model`), its linear layers still plain nn.Linear."""
        self.weight_dtype = resolve_weight_dtype(args, self.device, self.dtype)
        self.model = self.load_model(args.model_path, self.weight_dtype == "gguf")
        self.model.rope.to(dtype=torch.float32)

    def choose_and_apply_linear(self, args: ServerArgs) -> str | None:
        """Step 3: a mixture-of-experts model's experts path, then the linear layer kind of
        every layer and the LM head (layers/linear_plan.py), each logged with its reason and
        installed. Returns why batch invariance is off so far (None: still on), which the
        linear kind chosen depends on and may itself turn off."""
        self.experts_kind: str | None = None
        """The routed experts' path (ExpertsPlan.kind); None: the model has no experts."""
        if self.cfg.moe is not None:
            experts = choose_experts(self.weight_dtype, self.device, self.dtype)
            experts.install(self.model)
            self.experts_kind = experts.kind
            logger.info("experts: %s", experts.describe())
        off_because = batch_invariance_off_because(args, self.device, self.dtype, self.weight_dtype)
        linear = choose_linear(args.linear_weights, self.weight_dtype, self.device, self.dtype, off_because is None)
        linear.install(self.model)
        self.linear_kind = linear.kind
        logger.info("linear layers: %s", linear.describe())
        return off_because or linear.breaks_batch_invariance

    def allocate_kv_and_kernels(self, args: ServerArgs, invariance_off_because: str | None) -> None:
        """Step 4: the KV pool (as many pages on every rank), the C++ decode attention and
        elementwise kernels, whether batch invariance holds, and the compiled decode layer."""
        # Every rank must hold the same pages: the scheduler allocates from one pool.
        pool_tokens = self.tp.agree_min(kv_pool_tokens(args, self.cfg, self.dtype, self.device, self.plan.num_kv_heads))
        self.num_pages = pool_tokens // args.page_size + 1  # page 0 is the padding page
        self.kv_pool = KVPool(self.cfg, self.num_pages, args.page_size, self.dtype, self.device, self.plan.num_kv_heads)
        self.attention_backend = resolve_attention_backend(args, self.device)
        if self.attention_backend == "triton":
            kernels = load_triton_kernels(self.device)
            self.model.use_decode_kernel(kernels.decode)
            self.model.use_extend_kernel(kernels.extend)
            self.model.use_elementwise_kernels(kernels.elementwise)
        elif wants_decode_kernel(args.decode_attention, self.device):
            kernel = load_decode_kernel()
            if kernel is None and args.decode_attention == "kernel":
                raise RuntimeError("--decode-attention kernel: the kernel could not be built (see the log above)")
            if kernel is not None:
                self.model.use_decode_kernel(kernel)
        if self.device.type == "cpu" and self.attention_backend == "torch":
            self.model.use_elementwise_kernels(load_elementwise_kernels())
        off_because = invariance_off_because
        if off_because is None and self.attention_backend == "triton":
            off_because = "--attention-backend triton"
        if off_because is None and (self.model.decode_kernel is None or self.model.norm.kernels is None):
            off_because = "the C++ kernels are not built for this CPU"
        self.batch_invariant = off_because is None
        """Every row's logits are independent of its batch and of its tokens' path (batch_invariance.py)."""
        self.tp.sum_in_rank_order = self.batch_invariant
        if off_because is not None:
            logger.info("batch invariance off: %s", off_because)
        self.compiled = wants_compile(args.compile_decode, args.tp_size)
        if self.compiled:
            self.model.compile_decode()
            warm_up(lambda ids, pos, meta: self.model(ids, pos, self.kv_pool, meta, pos), self.device)

    def build_batch_state(self, args: ServerArgs) -> None:
        """Step 5: the n-gram drafter, the sampling table with its grammars, the pooler of
        embedding rows, and the batch state (the device-side rows the descriptors edit)."""
        self.num_draft_tokens = args.speculative_num_draft_tokens if args.speculative_algorithm else 0
        self.drafter = (
            NgramDrafter(
                args.max_running_requests,
                self.num_draft_tokens,
                args.speculative_ngram_min,
                args.speculative_ngram_max,
            )
            if self.num_draft_tokens
            else None
        )
        # Slack for drafts: the scheduler may allocate up to 2K+1 tokens past a row's length.
        max_pages_per_row = -(-(self.context_length + 2 * self.num_draft_tokens + 2) // args.page_size) + 1
        self.sampling = SamplingTable(
            args.max_running_requests, self.cfg.vocab_size, list(self.cfg.eos_token_ids), self.device
        )
        if self.device.type == "cpu":
            self.sampling.bf16_argmax = load_greedy_argmax()
        self.sampling.grammars = GrammarTable(
            args.max_running_requests, self.cfg.vocab_size, args.tokenizer_source, list(self.cfg.eos_token_ids)
        )
        self.pooler = Pooler(args.pooling, self.cfg.hidden_size, args.max_running_requests, self.device)
        self.state = BatchState(
            args.max_running_requests,
            max_pages_per_row,
            args.page_size,
            self.sampling,
            self.device,
            ragged_decode=self.model.decode_kernel is not None,
            every_query_through_kernel=self.batch_invariant,
        )

    def build_decode_graphs(self, args: ServerArgs) -> None:
        """Step 6: with the triton backend at tp 1, the decode-graph runner (decode_graphs.py),
        its buckets captured on CUDA; on CPU it runs the same steps without capture."""
        self.decode_graphs: DecodeGraphs | None = None
        if self.attention_backend != "triton" or args.disable_cuda_graph or self.tp.size > 1:
            return
        max_bs = min(args.cuda_graph_max_bs, args.max_running_requests)
        if max_bs <= 0:
            return
        self.decode_graphs = DecodeGraphs(self.model, self.kv_pool, self.state, max_bs)
        if self.device.type == "cuda":
            self.decode_graphs.capture()

    def load_model(self, model_path: str, quantized: bool) -> LlamaForCausalLM:
        """This rank's part of the model on the device in the worker's dtype, weights from the
        checkpoint (benchmarks/gpu_check.py builds random weights on the device instead)."""
        with weights_left_uninitialised(self.dtype):
            model = LlamaForCausalLM(self.cfg, self.plan, self.tp)
        model.load_weights(iter_weights(model_path, self.cfg, quantized))
        return model.to(device=self.device, dtype=self.dtype).eval()

    def summary(self) -> str:
        attention = "kernel" if self.model.decode_kernel is not None else "torch"
        if self.attention_backend == "triton":
            attention = "triton"
        compiled = "compiled" if self.compiled else "eager"
        if self.decode_graphs is not None:
            compiled = "graphs" if self.decode_graphs.graphs else "bucketed"
        invariant = "batch invariant" if self.batch_invariant else "not batch invariant"
        experts = "" if self.experts_kind is None else f", experts {self.experts_kind}"
        return (
            f"{self.dtype}, weights {self.weight_dtype}, linear {self.linear_kind}{experts}, decode {compiled}, "
            f"attention {attention}, {invariant}"
        )

    def agree_on_step(self, step_id: int, failed: bool) -> str | None:
        return self.tp.check_step(step_id, failed=failed)

    def on_reset(self) -> None:
        if self.drafter:
            for slot in range(len(self.drafter.history)):
                self.drafter.reset_slot(slot)

    def note_new_tokens(self, desc: BatchDescriptor, chunks: dict[int, tuple[np.ndarray, bool]]) -> None:
        for slot, (tokens, _) in chunks.items():
            self.sampling.note_prompt_tokens(slot, tokens)
        if self.drafter:
            for add in desc.added:
                self.drafter.reset_slot(add.slot)
            for slot, (tokens, _) in chunks.items():
                self.drafter.note_tokens(slot, tokens)

    def draft_tokens(self, slot: int) -> np.ndarray:
        return self.drafter.propose(slot)

    def forward_and_sample(self, plan: StepPlan | None) -> tuple[list[np.ndarray], list, list[PromptLogprobs]]:
        if plan is None:
            return [], [], []
        if self.decode_graphs is not None and self.decode_graphs.serves(plan):
            inputs: StepPlan = plan
            logits = self.decode_graphs.run(plan)
        else:
            inputs, logits = self._forward(plan)
        ends = np.cumsum(inputs.num_logits)
        prompt_logprobs = []
        if inputs.scored_chunks:
            prompt_logprobs = score_prompt_chunks(
                logits[int(ends[-1]) if len(ends) else 0 :],
                [(start, t, self.sampling.params[s].prompt_top_logprobs) for s, start, t in inputs.scored_chunks],
            )
        plain = [i for i, s in enumerate(inputs.sampling_slots) if s not in inputs.drafts]
        accepted: list[np.ndarray] = [None] * len(inputs.sampling_slots)  # type: ignore[list-item]
        logprobs: list = []
        if plain:
            tokens, plain_logprobs = sample(
                self._logit_rows(logits, ends[plain] - 1),
                [inputs.sampling_slots[i] for i in plain],
                self.sampling,
                self.tp.broadcast,
            )
            for i, t in zip(plain, self.state.readback.fetch(tokens)):
                accepted[i] = t.reshape(1)
            if plain_logprobs:
                logprobs = [None] * len(inputs.sampling_slots)
                for i, lp in zip(plain, plain_logprobs):
                    logprobs[i] = lp
        verifying = [i for i, s in enumerate(inputs.sampling_slots) if s in inputs.drafts]
        if verifying:
            for i, tokens in zip(verifying, self._verify(logits, inputs, ends, verifying)):
                accepted[i] = tokens
        self.state.advance(inputs, accepted)
        if self.drafter:
            for slot, toks in zip(inputs.sampling_slots, accepted):
                self.drafter.note_tokens(slot, toks)
        return accepted, logprobs, prompt_logprobs

    def _forward(self, plan: StepPlan) -> tuple[StepPlan, torch.Tensor]:
        """The plan's inputs and logits, eagerly; rows that pool an embedding are pooled here."""
        inputs = self.state.forward_inputs(plan)
        ids, positions, meta = inputs.input_ids, inputs.positions, inputs.meta
        if not plan.pooled_rows:
            # Without prompt chunks every token's logits are wanted, in order (plan_step).
            rows = None if not plan.extend_rows else inputs.logits_indices
            return inputs, self.model(ids, positions, self.kv_pool, meta, rows)
        states = self.model.last_layer_states(ids, positions, self.kv_pool, meta)
        logits = self.model.logits(states[inputs.logits_indices])
        pooled = torch.from_numpy(self.pooler.positions(plan)).to(self.device)
        self.pooler.pool(plan, self.model.final_hidden_states(states[pooled]))
        return inputs, logits

    def _logit_rows(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """The logits of `rows` (increasing); when they are every row (a decode step), the
        logits as they are. The index goes through the step's staging, not a copy of its own."""
        if len(rows) == len(logits):
            return logits
        index = self.state.staging.stage(rows, torch.int64)
        self.state.staging.flush()
        return logits.index_select(0, index)

    def _verify(self, logits: torch.Tensor, inputs: StepPlan, ends: np.ndarray, rows: list[int]) -> list[np.ndarray]:
        """Greedy verification of every drafting row at once (one argmax, one broadcast, one
        read-back, not one of each per row): a row keeps its drafts while they equal the
        model's argmax, plus one."""
        spans = [np.arange(ends[i] - inputs.num_logits[i], ends[i]) for i in rows]
        targets = self.state.readback.fetch(
            self.tp.broadcast(self.sampling.argmax(self._logit_rows(logits, np.concatenate(spans))))
        )
        out, start = [], 0
        for i, span in zip(rows, spans):
            slot = inputs.sampling_slots[i]
            draft, row = inputs.drafts[slot], targets[start : start + len(span)]
            start += len(span)
            matches = row[:-1] == draft
            accepted_drafts = len(draft) if matches.all() else int(np.argmin(matches))
            self.sampling.generated[slot] += accepted_drafts + 1
            out.append(row[: accepted_drafts + 1])
        return out

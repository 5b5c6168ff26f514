"""The worker process: model, KV tensors, device seq_lens, sampling, and its loop.

Each step: receive a descriptor, apply the delta to the persistent batch, (on the
overlapped path) publish the one seq_lens sync, run the forward, sample, advance, reply.
Only rank 0 replies.

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

from gpu_worker.batch_state import BatchState, ForwardInputs, StepGapError
from gpu_worker.kv_pool import KVPool, kv_bytes_per_token
from gpu_worker.model import LlamaForCausalLM
from gpu_worker.model_config import ModelConfig
from gpu_worker.ngram_drafter import NgramDrafter, can_draft
from gpu_worker.parallel import ShardPlan, TPGroup, dist_port
from gpu_worker.sampler import SamplingTable, sample
from gpu_worker.weights import iter_weights, load_config
from wire.backend import (
    BatchDescriptor,
    ForwardMode,
    ResetBatch,
    SeqLensSync,
    StepResult,
    WorkerCounters,
    WorkerError,
    WorkerInput,
    WorkerReady,
)
from wire.child import ChildContext
from wire.cluster import layout_of, signer_of
from wire.codec import pack_int32
from wire.control import PROTOCOL_VERSION
from wire.server_args import ServerArgs
from wire.transport import (
    PullSocket,
    PushSocket,
    endpoint,
    peer_id,
    scheduler_reply_endpoint,
    worker_endpoint,
)

logger = logging.getLogger(__name__)
MIN_COLLECTIVE_TIMEOUT_S = 30.0


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        # bf16 matmuls only pay off on CPUs with native bf16 (AVX512-BF16 / AMX).
        return torch.bfloat16 if "AVX512" in torch.backends.cpu.get_cpu_capability() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


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


def open_worker_inbox(ctx: ChildContext) -> PullSocket:
    """Descriptors from the scheduler: an ipc socket beside it, or, for a rank on another
    node, a signed tcp link to the scheduler's node that names this rank."""
    args, name = ctx.args, f"{ctx.name}.in"
    if layout_of(args).is_remote_rank(ctx.rank):
        address = layout_of(args).descriptor_address(ctx.dp_rank)
        return PullSocket(
            ctx.zmq_ctx, address, False, WorkerInput, name, signer_of(args), peer_id(ctx.dp_rank, ctx.rank)
        )
    return PullSocket(
        ctx.zmq_ctx, endpoint(args.run_dir, worker_endpoint(ctx.dp_rank, ctx.rank)), True, WorkerInput, name
    )


def worker_device(args: ServerArgs, rank: int, dp_rank: int) -> torch.device:
    """Each worker on a node has a GPU of its own, counted from --base-gpu-id."""
    if args.device == "cuda":
        layout = layout_of(args)
        local_index = dp_rank * layout.ranks_per_node + rank - layout.local_ranks().start
        device = torch.device(f"cuda:{args.base_gpu_id + local_index}")
        torch.cuda.set_device(device)
        return device
    return torch.device(args.device)


class Worker:
    def __init__(self, ctx: ChildContext) -> None:
        args = ctx.args
        self.args = args
        self.rank = ctx.rank
        self.device = worker_device(args, ctx.rank, ctx.dp_rank)
        if self.device.type == "cpu":  # the workers of this node share its cores
            workers_here = args.dp_size * layout_of(args).ranks_per_node
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers_here))
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.cfg = load_config(args.model_path)
        self.context_length = min(args.context_length or self.cfg.max_position, self.cfg.max_position)
        # Checked before joining the group, so that a bad --tp-size is a clear start-up error on every rank.
        self.plan = ShardPlan.build(self.cfg, ctx.rank, args.tp_size)
        # A collective that waits longer than this raises, and the rank exits (a peer died or
        # desynchronised); normally the supervisor or the scheduler's watchdog restarts the group first.
        timeout_s = max(MIN_COLLECTIVE_TIMEOUT_S, args.watchdog_timeout_s)
        self.tp = TPGroup.init(ctx.rank, args.tp_size, self.device, dist_port(), timeout_s, args.dist_init_host)
        if args.tp_size > 1:
            logger.info("%s", self.plan.describe())

        t0 = time.monotonic()
        model = LlamaForCausalLM(self.cfg, self.plan, self.tp)
        model.load_weights(iter_weights(args.model_path, self.cfg))
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.model.rope.to(dtype=torch.float32)
        logger.info("loaded %s in %.1f s (%s, %s)", args.model_path, time.monotonic() - t0, self.dtype, self.device)

        # Every rank must hold the same pages: the scheduler allocates from one pool.
        pool_tokens = self.tp.agree_min(kv_pool_tokens(args, self.cfg, self.dtype, self.device, self.plan.num_kv_heads))
        self.num_pages = pool_tokens // args.page_size + 1  # page 0 is the padding page
        self.kv_pool = KVPool(self.cfg, self.num_pages, args.page_size, self.dtype, self.device, self.plan.num_kv_heads)
        self.num_draft_tokens = args.speculative_num_draft_tokens if args.speculative_algorithm else 0
        self.drafter = NgramDrafter(args.max_running_requests, self.num_draft_tokens) if self.num_draft_tokens else None
        # Slack for drafts: the scheduler may allocate up to 2K+1 tokens past a row's length.
        max_pages_per_row = -(-(self.context_length + 2 * self.num_draft_tokens + 2) // args.page_size) + 1
        self.sampling = SamplingTable(
            args.max_running_requests, self.cfg.vocab_size, list(self.cfg.eos_token_ids), self.device
        )
        self.state = BatchState(
            args.max_running_requests, max_pages_per_row, args.page_size, self.sampling, self.device
        )
        self.counters = WorkerCounters()

        self.inbox = open_worker_inbox(ctx)
        self.reply = (
            PushSocket(ctx.zmq_ctx, endpoint(args.run_dir, scheduler_reply_endpoint(ctx.dp_rank)), bind=False)
            if ctx.rank == 0
            else None
        )

    def ready_message(self) -> WorkerReady:
        return WorkerReady(
            protocol_version=PROTOCOL_VERSION,
            rank=self.rank,
            num_pages=self.num_pages,
            page_size=self.args.page_size,
            vocab_size=self.cfg.vocab_size,
            context_length=self.context_length,
            eos_token_ids=list(self.cfg.eos_token_ids),
            max_running_requests=self.args.max_running_requests,
        )

    def run_forever(self) -> None:
        self._send(self.ready_message())
        while True:
            wait_start = time.perf_counter()
            msg = self.inbox.recv()
            step_start = time.perf_counter()
            if isinstance(msg, BatchDescriptor):
                if self.state.order:  # waiting with rows in the batch is time the scheduler cost
                    self.counters.idle_s += step_start - wait_start
                result = self.step(msg)
                self.counters.busy_s += time.perf_counter() - step_start
                if isinstance(result, StepResult):
                    result.counters.busy_s, result.counters.idle_s = self.counters.busy_s, self.counters.idle_s
                self._send(result)
            elif isinstance(msg, ResetBatch):
                self.state.reset(msg.next_step_id)
                if self.drafter:
                    for slot in range(len(self.drafter.history)):
                        self.drafter.reset_slot(slot)
                self._send(self.ready_message())

    def step(self, desc: BatchDescriptor) -> StepResult | WorkerError:
        failure = None
        try:
            chunks = self.state.apply(desc)
        except StepGapError as e:
            # Refused before any state changed, and before meeting the other ranks: a stale or
            # forged frame is a no-op here. A rank that really missed a step never meets its
            # peers again; they time out (or the scheduler's watchdog restarts the group).
            logger.error("step %d rejected: %s", desc.step_id, e)
            return WorkerError(desc.step_id, str(e))
        except Exception as e:  # a bad delta: refuse rather than compute on stale state
            failure = str(e)
        # Every rank that accepted the step id meets here, failed or not: none computes alone.
        disagreement = self.tp.check_step(desc.step_id, failed=failure is not None)
        error = failure or disagreement
        if error is not None:
            logger.error("step %d rejected: %s", desc.step_id, error)
            return WorkerError(desc.step_id, error)
        t0 = time.perf_counter()
        self._note_new_tokens(desc, chunks)
        inputs = self.state.build_forward(chunks, self._propose_drafts())
        if self._is_overlapped(desc):
            self._publish_seq_lens_sync(desc.step_id)
        accepted, logprobs = self._forward_and_sample(inputs)
        self.counters.steps += 1
        seq_lens = None
        if self.args.check_seq_lens:
            try:
                if not self.drafter:  # with drafts the descriptor's sum is an estimate
                    self.state.check_seq_lens_sum(desc)
            except Exception as e:
                logger.error("%s", e)
                return WorkerError(desc.step_id, str(e))
            seq_lens = pack_int32(self.state.copy_seq_lens_to_host(for_debug_check=True))
        self.counters.seq_lens_d2h_copies = self.state.seq_lens_d2h_copies
        self.counters.dropped_frames = self.inbox.dropped
        flat = np.concatenate(accepted) if accepted else np.zeros(0, dtype=np.int64)
        return StepResult(
            step_id=desc.step_id,
            next_token_ids=pack_int32(flat),
            counters=WorkerCounters(**{f: getattr(self.counters, f) for f in WorkerCounters.__struct_fields__}),
            forward_time_s=time.perf_counter() - t0,
            logprobs=logprobs,
            accept_lens=pack_int32([len(a) for a in accepted]) if self.drafter else b"",
            seq_lens=seq_lens,
        )

    def _note_new_tokens(self, desc: BatchDescriptor, chunks: dict[int, tuple[np.ndarray, bool]]) -> None:
        for slot, (tokens, _) in chunks.items():
            self.sampling.note_prompt_tokens(slot, torch.from_numpy(tokens.astype("int64")).to(self.device))
        if self.drafter:
            for add in desc.added:
                self.drafter.reset_slot(add.slot)
            for slot, (tokens, _) in chunks.items():
                self.drafter.note_tokens(slot, tokens)

    def _propose_drafts(self) -> dict[int, np.ndarray]:
        if not self.drafter:
            return {}
        drafts = {}
        for slot in self.state.order:
            if self.state.decoding[slot] and can_draft(self.sampling.params[slot]):
                room = self.context_length - int(self.state.row_lens_host[slot]) - 1
                draft = self.drafter.propose(slot)[: max(0, room)]
                if len(draft):
                    drafts[slot] = draft
        return drafts

    def _is_overlapped(self, desc: BatchDescriptor) -> bool:
        return not self.args.disable_overlap and desc.forward_mode in (ForwardMode.DECODE, ForwardMode.MIXED)

    def _publish_seq_lens_sync(self, step_id: int) -> None:
        """The single sync point: one device-to-host copy, before the overlapped forward."""
        host = self.state.copy_seq_lens_to_host()
        self._send(SeqLensSync(step_id, pack_int32(host), int(host.sum())))

    def _forward_and_sample(self, inputs: ForwardInputs | None) -> tuple[list[np.ndarray], list]:
        """Runs the batch; returns the accepted tokens of each sampling row, and logprobs."""
        if inputs is None:
            return [], []
        logits = self.model(inputs.input_ids, inputs.positions, self.kv_pool, inputs.meta, inputs.logits_indices)
        self.counters.prefill_tokens_computed += inputs.num_prefill_tokens
        ends = np.cumsum(inputs.num_logits)
        plain = [i for i, s in enumerate(inputs.sampling_slots) if s not in inputs.drafts]
        accepted: list[np.ndarray] = [None] * len(inputs.sampling_slots)  # type: ignore[list-item]
        logprobs: list = []
        if plain:
            rows = torch.from_numpy(ends[plain] - 1).to(self.device)
            tokens, plain_logprobs = sample(
                logits[rows], [inputs.sampling_slots[i] for i in plain], self.sampling, self.tp.broadcast
            )
            for i, t in zip(plain, tokens.cpu().numpy()):
                accepted[i] = t.reshape(1)
            if plain_logprobs:
                logprobs = [None] * len(inputs.sampling_slots)
                for i, lp in zip(plain, plain_logprobs):
                    logprobs[i] = lp
        for i, slot in enumerate(inputs.sampling_slots):
            if slot in inputs.drafts:
                accepted[i] = self._verify(logits[ends[i] - inputs.num_logits[i] : ends[i]], inputs.drafts[slot], slot)
        self.state.advance(inputs, accepted)
        if self.drafter:
            for slot, toks in zip(inputs.sampling_slots, accepted):
                self.drafter.note_tokens(slot, toks)
        return accepted, logprobs

    def _verify(self, logits: torch.Tensor, draft: np.ndarray, slot: int) -> np.ndarray:
        """Greedy verification: keep drafts while they equal the model's argmax, plus one."""
        targets = self.tp.broadcast(logits.argmax(dim=-1)).cpu().numpy()
        matches = targets[:-1] == draft
        accepted_drafts = len(draft) if matches.all() else int(np.argmin(matches))
        self.sampling.generated[slot] += accepted_drafts + 1
        return targets[: accepted_drafts + 1]

    def _send(self, msg) -> None:
        if self.reply is not None:
            self.reply.send(msg)

"""Tensor parallelism: which slice of the model a rank holds, and the collectives it runs.

Each worker rank is its own process in one torch.distributed group (gloo on CPU, NCCL on
CUDA), rendezvoused through a TCPStore that rank 0 serves on 127.0.0.1 at a port the
supervisor picks afresh for every generation of the worker group (TRIDENT_DIST_INIT_PORT;
the first generation uses `ServerArgs.dist_init_port`), so a restarted group never meets
the previous one's sockets. When Ray places the ranks, the store is on the node that holds
rank 0, named by DIST_HOST_ENV.

How the LLaMA decoder is cut (Megatron-style):

    qkv_proj, gate_up_proj   column-parallel: each rank holds its heads' rows of q, k and v
                             (each section split on its own), its slice of gate and of up
    o_proj, down_proj        row-parallel: partial sums, then one all-reduce
    embed_tokens             vocabulary-parallel: a rank looks up the ids in its rows,
                             zeroes the rest, all-reduce
    lm_head (tied or not)    vocabulary-parallel: each rank computes its logits columns,
                             all-gather, so every rank holds the same full logits

Heads need not split evenly. Query heads are cut into contiguous, balanced ranges (9 heads
at tp 2: 0-3 and 4-8); each rank holds every KV head its query heads read, so a KV head
whose group straddles two ranks is replicated on both (SmolLM2 at tp 2: KV head 1 lives on
both ranks), and a model with fewer KV heads than ranks replicates each on several ranks.
Output is unchanged because attention is per head and o_proj sums over heads, whoever
computes them. The only configuration refused is more ranks than query heads.

Every rank ends a step with the same logits; sampled token ids are still broadcast from
rank 0 (its tokens are authoritative) so that an unseeded draw, which uses each process's
own RNG, cannot make the ranks feed different next tokens.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpu_worker.model.model_config import ModelConfig
from trident.wire.control import DIST_HOST_ENV

logger = logging.getLogger(__name__)

DIST_PORT_ENV = "TRIDENT_DIST_INIT_PORT"


class TensorParallelError(ValueError):
    """The model cannot be split across this many ranks."""


def _balanced(n: int, size: int, rank: int) -> tuple[int, int]:
    return rank * n // size, (rank + 1) * n // size


@dataclass(frozen=True)
class ShardPlan:
    """The slice of each sharded dimension that one rank holds (half-open ranges)."""

    rank: int
    size: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_rows: int
    """Rows of this rank's embedding/LM-head shard, padded so every rank's is the same size."""
    kv_of_head: tuple[int, ...]
    """Local KV-head index read by each local query head."""
    expert_intermediate: tuple[int, int] = (0, 0)
    """This rank's slice of every routed expert's intermediate dimension (vLLM's MoE tensor
    parallelism): gate/up by rows, down by columns, one all-reduce after the experts."""
    shared_intermediate: tuple[int, int] = (0, 0)
    """This rank's slice of the shared expert's intermediate dimension (Qwen2-MoE)."""

    @classmethod
    def build(cls, cfg: ModelConfig, rank: int, size: int) -> ShardPlan:
        if size < 1:
            raise TensorParallelError(f"tensor parallel size must be at least 1, not {size}")
        if size > cfg.num_heads:
            raise TensorParallelError(
                f"--tp-size {size} cannot split the model's {cfg.num_heads} attention heads "
                f"({cfg.num_kv_heads} KV heads): every rank needs at least one head; use --tp-size <= {cfg.num_heads}"
            )
        if cfg.num_heads % cfg.num_kv_heads:
            raise TensorParallelError(
                f"{cfg.num_heads} attention heads are not a multiple of {cfg.num_kv_heads} KV heads"
            )
        group = cfg.num_heads // cfg.num_kv_heads
        h0, h1 = _balanced(cfg.num_heads, size, rank)
        kv0, kv1 = h0 // group, (h1 - 1) // group + 1
        rows = -(-cfg.vocab_size // size)
        return cls(
            rank=rank,
            size=size,
            heads=(h0, h1),
            kv_heads=(kv0, kv1),
            intermediate=_balanced(cfg.intermediate_size, size, rank),
            vocab=(min(rank * rows, cfg.vocab_size), min((rank + 1) * rows, cfg.vocab_size)),
            vocab_rows=rows,
            kv_of_head=tuple(h // group - kv0 for h in range(h0, h1)),
            expert_intermediate=_balanced(cfg.moe.intermediate_size, size, rank) if cfg.moe else (0, 0),
            shared_intermediate=_balanced(cfg.moe.shared_intermediate_size, size, rank) if cfg.moe else (0, 0),
        )

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def uniform_gqa(self) -> bool:
        """True when SDPA's own GQA grouping (head h reads KV head h // group) is this rank's."""
        n, kv = self.num_heads, self.num_kv_heads
        return n % kv == 0 and all(k == h // (n // kv) for h, k in enumerate(self.kv_of_head))

    def describe(self) -> str:
        return (
            f"tp{self.rank}/{self.size}: heads {self.heads[0]}-{self.heads[1] - 1}, "
            f"KV heads {self.kv_heads[0]}-{self.kv_heads[1] - 1}, intermediate {self.intermediate[0]}:"
            f"{self.intermediate[1]}, vocab {self.vocab[0]}:{self.vocab[1]}"
        )


class TPGroup:
    """The collectives of one rank. With one rank every operation is the identity and no
    process group exists, so tp 1 runs exactly the code it ran before."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self.rank = rank
        self.size = size
        self.device_group: dist.ProcessGroup | None = None
        """NCCL on CUDA, gloo on CPU: activations, logits, sampled tokens."""
        self.cpu_group: dist.ProcessGroup | None = None
        """Always gloo: the step-id check and start-up agreement, which must not touch the GPU stream."""
        self._store: dist.TCPStore | None = None
        self.sum_in_rank_order = False
        """all_reduce adds the ranks' parts in rank order (batch invariance; set by the worker)."""

    @classmethod
    def init(
        cls, rank: int, size: int, device: torch.device, port: int, timeout_s: float, host: str = "127.0.0.1"
    ) -> TPGroup:
        tp = cls(rank, size)
        if size == 1:
            return tp
        if not port:
            raise TensorParallelError(f"tp size {size} needs a rendezvous port ({DIST_PORT_ENV})")
        if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            # Every rank on this host: the backends' own sockets stay on loopback too.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        timeout = datetime.timedelta(seconds=timeout_s)
        listen_fd = None
        if rank == 0:
            # Bind the store ourselves, on the one given address: TCPStore's own listener
            # would take every interface.
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(size * 4)
            listen_fd = sock.detach()
        tp._store = dist.TCPStore(
            host, port, size, rank == 0, timeout=timeout, wait_for_workers=False, master_listen_fd=listen_fd
        )
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, store=tp._store, rank=rank, world_size=size, timeout=timeout, **kwargs)
        tp.device_group = dist.group.WORLD
        tp.cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
        logger.info("joined the %s group as rank %d of %d (store %s:%d)", backend, rank, size, host, port)
        return tp

    # ---------------------------------------------------------------- model collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, in place. With `sum_in_rank_order` above 2 ranks, the parts
        are gathered and added in rank order: a ring all-reduce adds each element in an order
        that depends on where the tensor's size puts it (at 2 ranks, a + b == b + a)."""
        if self.size > 2 and self.sum_in_rank_order:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous(), group=self.device_group)
            total = parts[0]
            for part in parts[1:]:
                total += part
            return x.copy_(total)
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def embed(
        self, ids: torch.Tensor, rows: Callable[[torch.Tensor], torch.Tensor], vocab: tuple[int, int]
    ) -> torch.Tensor:
        """Vocabulary-parallel lookup: `rows(local ids)` gives this rank's embedding rows (a
        dense table or a quantized one); rows this rank does not hold contribute zeros."""
        if self.size == 1:
            return rows(ids)
        mine = (ids >= vocab[0]) & (ids < vocab[1])
        out = rows(torch.where(mine, ids - vocab[0], 0))
        out.masked_fill_(~mine.unsqueeze(-1), 0)
        return self.all_reduce(out)

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[rows, vocab_rows] on each rank -> the same [rows, vocab_size] on every rank."""
        if self.size == 1 or local.numel() == 0:
            return local if self.size == 1 else local.new_empty(local.shape[0], vocab_size)
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's values, on every rank (sampled tokens: rank 0 is authoritative)."""
        if self.size > 1 and x.numel():
            x = x.contiguous()
            dist.broadcast(x, src=0, group=self.device_group)
        return x

    # ---------------------------------------------------------------- control

    def check_step(self, step_id: int, failed: bool) -> str | None:
        """Every rank that accepted a descriptor meets here: None when all ranks are on the same
        step and none failed to apply it, else the reason (the same on every rank)."""
        if self.size == 1:
            return None
        t = torch.tensor([step_id, -step_id, int(failed)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        hi, lo, any_failed = int(t[0]), -int(t[1]), int(t[2])
        if hi != lo:
            return f"tensor-parallel ranks disagree on the step id (steps {lo} to {hi})"
        if any_failed:
            return f"a tensor-parallel rank could not apply step {step_id}"
        return None

    def agree_min(self, value: int) -> int:
        """The smallest of the ranks' values (the KV pool size: the scheduler sees one pool)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t[0])


def dist_address(default_host: str) -> tuple[str, int]:
    """The rendezvous host and port of this generation of the worker group (set by the
    supervisor; the host only when Ray placed rank 0 on a node of its choosing)."""
    return os.environ.get(DIST_HOST_ENV) or default_host, int(os.environ.get(DIST_PORT_ENV) or 0)

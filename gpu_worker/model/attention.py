"""Attention over the paged KV pool, for a flat batch of rows of different lengths.

Short rows (a decode token, or a decode token plus a few draft tokens to verify) run as
batched matmuls over their gathered keys. Rows are grouped by KV length (`DecodeGroup`),
so a long row does not pad every short one up to its length; inside a group, rows are
padded to the group's longest and the padding is masked by an additive bias. On CPU,
two matmuls and a float32 softmax are several times faster than SDPA's flash kernel at
one query per row, whose blocking is built for long queries.

Long rows (prompt chunks) run one SDPA call each with a causal mask shifted by the row's
cached prefix. A chunk with no cached prefix attends only to its own new keys, which are
still at hand, so it reads nothing from the pool.

The pool stores K and V of a token side by side (kv_pool.py), so one `index_select` per
layer gathers both, already in the [row, kv head, position, dim] layout the matmuls read.
The gather index of each group is built once per forward (`prepare_gather`) and shared by
every layer.

A layer with a sliding window of w keys (Mistral, Gemma 3's local layers) lets a query at
position p see keys p - w + 1 .. p. Its masks (`window_bias`, `window_masks`) are built
once per forward by `prepare_windows` and shared by every layer of that window; the C++
kernel takes the window itself. The pool keeps every key: only the masks change.

On CPU, groups of one query per row go instead to a C++ kernel that reads each row's keys
where the pool has them (csrc/paged_decode_attention.cpp, `--decode-attention`): no copy,
no padding, so it skips the gather that dominated the torch path (docs/benchmarks.md,
"Kernels").

On CUDA (`--attention-backend triton`, gpu_worker/kernels/triton/) the same two hooks take
Triton kernels: the decode kernel, and an extend kernel that runs a prompt chunk over its
prefix and itself from the pool (the layer writes the chunk's K/V first), instead of SDPA.

With batch invariance (batch_invariance.py) every query of a step goes to that kernel, a
prompt chunk's tokens and a draft's tokens too, each as its own row (`QueryKeys`): a query's
output is then the same bits whether it is decoded, prefilled, verified, chunked or read
over a cached prefix, and whatever else runs in its step. The kernel takes a prompt chunk's
consecutive queries in tiles that read each K and V row once for the tile, in the decode
loop's order of additions (csrc/query_tile_attention.cpp).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gpu_worker.kernels.cpu_kernels import DecodeKernel

ExtendKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float, int], torch.Tensor]
"""(q [q_len, heads, dim], kv_cache, kv_indices [prefix + q_len], prefix, scale, window) -> out
[q_len, heads, dim]: a prompt chunk whose K/V are already in the pool, causal over its prefix."""


@dataclass
class ExtendRow:
    q_start: int
    """Offset of the row's first query token in the flat batch."""
    q_len: int
    prefix_len: int
    """Tokens already in the pool before this chunk."""
    kv_indices: torch.Tensor
    """Pool indices of all prefix_len + q_len tokens of the row."""
    causal_mask: torch.Tensor | None
    """None when prefix_len == 0 (plain causal)."""
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    """window -> the causal mask cut to the window, bool [q_len, prefix_len + q_len]; set by
    prepare_windows."""


@dataclass
class DecodeGroup:
    """Short rows of similar KV length, padded to the longest of them."""

    token_idx: torch.Tensor
    """Flat-batch index of each row's query tokens, padded by repeating the row's last
    token, [rows, max_q]."""
    q_valid: torch.Tensor
    """True where token_idx is a real query, [rows, max_q]."""
    kv_indices: torch.Tensor
    """Pool token index per row and key position, padded with 0, [rows, max_kv_len]."""
    kv_lens: torch.Tensor
    """Keys each row's last query sees (its KV length after this step), int64 [rows]."""
    bias: torch.Tensor
    """0 where query i of a row may see key j (j <= prefix + i), -inf elsewhere,
    float32 [rows, 1, max_q, 1, max_kv_len]."""
    covers_batch: bool
    """The group is the whole batch, one query per row, in batch order (a plain decode
    step): queries and outputs need no index."""
    gather_index: torch.Tensor | None = None
    """Rows of the pool viewed as [tokens * 2 * kv_heads, dim], [2, rows, heads', max_kv_len];
    set by prepare_gather."""
    window_bias: dict[int, torch.Tensor] = field(default_factory=dict)
    """window -> `bias` with the keys before each query's window also -inf; set by
    prepare_windows for the groups the torch path computes."""
    kv_rows: torch.Tensor | None = None
    """Each row's row of kv_indices, int64 [rows] (None: its own): set where kv_indices is a
    persistent table of every slot (the CUDA-graph runner, decode_graphs.py); only the decode
    kernel reads a group that has it."""


@dataclass
class QueryKeys:
    """Every query token of a step as its own row of the decode kernel (batch invariance):
    query t reads the first kv_lens[t] keys of row kv_rows[t] of kv_table."""

    kv_table: torch.Tensor
    """Pool index of each computing sequence's keys, through this step's tokens, padded with
    0, int64 [sequences, max_kv]."""
    kv_rows: torch.Tensor
    """Each query token's row of kv_table, int64 [num_tokens]."""
    kv_lens: torch.Tensor
    """Keys each query token sees, itself included (its position + 1), int64 [num_tokens]."""


@dataclass
class AttentionMetadata:
    out_cache_loc: torch.Tensor
    """Pool index each new token's K/V is written to, [num_tokens]."""
    decode_groups: list[DecodeGroup]
    extend_rows: list[ExtendRow]
    query_keys: QueryKeys | None = None
    """Set (by batch_state.py) when every query of a step with prompt chunks or drafts goes
    through the decode kernel; the groups and rows above then only describe the step."""

    def reads_pool_only(self) -> bool:
        """Attention reads K/V from the pool only, so the step's new K/V can be written there
        before it (the fused rotary_write_kv op) and need not be kept at hand."""
        return not self.extend_rows or self.query_keys is not None

    def is_plain_decode(self) -> bool:
        """Every row one query (no draft to verify) and no prompt chunk: the step reads K/V
        from the pool only (the flat loop and the compiled layer take only such steps)."""
        return not self.extend_rows and all(kernel_serves(g) for g in self.decode_groups)

    def prepare_gather(self, num_kv_heads: int, kv_head_of: torch.Tensor, kernel: DecodeKernel | None = None) -> None:
        """Builds the gather index, once per forward, of each group that the decode kernel
        (if any) does not serve.

        `kv_head_of[h']` is the pool's KV head behind the h'-th head of the gathered
        layout: arange(kv_heads) for plain GQA, or one entry per query head when a
        tensor-parallel rank's heads straddle KV groups (parallel.py).
        """
        if self.query_keys is not None:
            return
        kv_or_v = torch.arange(2, device=kv_head_of.device)[:, None, None, None]
        for g in self.decode_groups:
            if kernel is not None and kernel_serves(g):
                continue
            token = g.kv_indices[None, :, None, :]
            g.gather_index = (token * 2 + kv_or_v) * num_kv_heads + kv_head_of[None, None, :, None]

    def prepare_windows(self, windows: set[int], kernel: DecodeKernel | None = None) -> None:
        """Builds, once per forward, the masks of each sliding window (in keys) some layer uses."""
        if self.query_keys is not None:
            return
        for window in windows:
            for g in self.decode_groups:
                if kernel is None or not kernel_serves(g):
                    g.window_bias[window] = _window_bias(g.bias, window)
            for row in self.extend_rows:
                row.window_masks[window] = windowed_causal_mask(
                    row.q_len, row.prefix_len, window, row.kv_indices.device
                )


class StraddlingHeadsKernel:
    """The decode kernel for a tensor-parallel rank whose query heads straddle KV groups
    (parallel.py; SmolLM2's 9 heads at tp 2): the kernel reads KV head h // group for query
    head h, so the rank's heads are placed in the slots of whole groups over its KV heads,
    the empty slots zero, and only the real heads' outputs are kept."""

    def __init__(self, kernel: DecodeKernel, head_slots: list[int], group: int, kv_heads: int) -> None:
        self.kernel = kernel
        self.head_slots = torch.tensor(head_slots, dtype=torch.int64)
        """Each local query head's slot among the kv_heads * group of the kernel's layout."""
        self.slots = kv_heads * group

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, *args) -> torch.Tensor:
        padded = q.new_zeros(q.shape[0], self.slots, q.shape[2])
        padded[:, self.head_slots] = q
        return self.kernel(padded, kv_cache, *args).index_select(1, self.head_slots)


def kernel_serves(g: DecodeGroup) -> bool:
    """The decode kernel computes groups of one query per row (no draft to verify)."""
    return g.token_idx.shape[1] == 1


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_head_map: torch.Tensor | None = None,
    kernel: DecodeKernel | None = None,
    window: int = 0,
    scale: float | None = None,
    extend_kernel: ExtendKernel | None = None,
) -> torch.Tensor:
    """q: [num_tokens, heads, dim], this step's k/v: [num_tokens, kv_heads, dim] (already in
    kv_cache [pool tokens, 2, kv_heads, dim]; None in a step that reads the pool only,
    `meta.reads_pool_only()`) -> [num_tokens, heads, dim].

    Query head h reads KV head h // (heads // kv_heads) (SDPA's GQA grouping), unless
    `kv_head_map` gives each query head's KV head: a tensor-parallel rank whose heads
    straddle KV groups (parallel.py); prepare_gather must then have been given the same map.
    `kernel` (the C++ decode kernel; a StraddlingHeadsKernel with a kv_head_map) serves the
    groups it can.
    `window`: the layer's sliding window in keys (0: none; prepare_windows must have been
    given it); `scale`: the score scale (None: dim ** -0.5).
    `extend_kernel` (Triton) runs each prompt chunk from the pool, where this step's K/V
    already are; without one, or with a kv_head_map, SDPA does."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if (keys := meta.query_keys) is not None:
        assert kernel is not None, "query_keys are built only for the decode kernel"
        return kernel(q, kv_cache, keys.kv_table, keys.kv_lens, scale, window, keys.kv_rows)
    if len(meta.decode_groups) == 1 and meta.decode_groups[0].covers_batch:
        g = meta.decode_groups[0]
        if kernel is not None:
            return _kernel_group(q, kv_cache, g, kernel, scale, window)
        return _decode_group(q, kv_cache, g, scale, window)
    out = torch.empty_like(q)
    for g in meta.decode_groups:
        if kernel is not None and kernel_serves(g):
            out.index_copy_(0, g.token_idx[:, 0], _kernel_group(q, kv_cache, g, kernel, scale, window))
            continue
        rows = _decode_group(q, kv_cache, g, scale, window)  # [rows, max_q, heads, dim]
        if g.token_idx.shape[1] == 1:
            out.index_copy_(0, g.token_idx[:, 0], rows[:, 0])
        else:
            out[g.token_idx[g.q_valid]] = rows[g.q_valid]
    for row in meta.extend_rows:
        assert k is not None and v is not None, "extend rows attend to this step's k and v"
        sl = slice(row.q_start, row.q_start + row.q_len)
        if extend_kernel is not None and kv_head_map is None:
            out[sl] = extend_kernel(q[sl], kv_cache, row.kv_indices, row.prefix_len, scale, window)
            continue
        out[sl] = _extend_row(q[sl], k[sl], v[sl], kv_cache, row, kv_head_map, scale, window)
    return out


def _kernel_group(
    q: torch.Tensor, kv_cache: torch.Tensor, g: DecodeGroup, kernel: DecodeKernel, scale: float, window: int
) -> torch.Tensor:
    """[rows, heads, dim] of a group of one query per row."""
    qs = q if g.covers_batch else q.index_select(0, g.token_idx[:, 0])
    if g.kv_rows is not None:
        return kernel(qs, kv_cache, g.kv_indices, g.kv_lens, scale, window, g.kv_rows)
    return kernel(qs, kv_cache, g.kv_indices, g.kv_lens, scale, window)


def _decode_group(q: torch.Tensor, kv_cache: torch.Tensor, g: DecodeGroup, scale: float, window: int) -> torch.Tensor:
    """[rows, heads, dim] when the group covers the batch, else [rows, max_q, heads, dim]."""
    assert g.gather_index is not None, "prepare_gather was not called"
    _, rows, heads_kv, max_kv = g.gather_index.shape
    dim = q.shape[-1]
    heads = q.shape[1]
    group = heads // heads_kv
    max_q = g.token_idx.shape[1]
    kv = kv_cache.view(-1, dim).index_select(0, g.gather_index.view(-1)).view(2, rows, heads_kv, max_kv, dim)
    qs = q if g.covers_batch else q[g.token_idx]  # [rows, (max_q,) heads, dim]
    # Query head h = kv head * group + i reads KV head h // group: order queries [rows, kv head, q, i].
    qs = qs.view(rows, max_q, heads_kv, group, dim).transpose(1, 2).reshape(rows, heads_kv, max_q * group, dim)
    scores = torch.matmul(qs, kv[0].transpose(-1, -2)).view(rows, heads_kv, max_q, group, max_kv)
    # bias + scale * scores in one op, in float32 whatever the model's dtype (as the reference does).
    bias = g.window_bias[window] if window else g.bias
    probs = torch.add(bias, scores, alpha=scale).softmax(dim=-1).to(q.dtype)
    out = torch.matmul(probs.view(rows, heads_kv, max_q * group, max_kv), kv[1])
    out = out.view(rows, heads_kv, max_q, group, dim).transpose(1, 2)
    return out.reshape(rows, heads, dim) if g.covers_batch else out.reshape(rows, max_q, heads, dim)


def _extend_row(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    row: ExtendRow,
    kv_head_map: torch.Tensor | None,
    scale: float,
    window: int,
) -> torch.Tensor:
    if row.prefix_len:
        kv = kv_cache.index_select(0, row.kv_indices)  # [n, 2, kv_heads, dim]
        k, v = kv[:, 0], kv[:, 1]
    if kv_head_map is not None:
        k, v = k.index_select(1, kv_head_map), v.index_select(1, kv_head_map)
    qe, ke, ve = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    mask = row.window_masks[window] if window else row.causal_mask
    oe = F.scaled_dot_product_attention(
        qe, ke, ve, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )
    return oe.squeeze(0).transpose(0, 1)


def _window_bias(bias: torch.Tensor, window: int) -> torch.Tensor:
    """`bias` ([rows, 1, max_q, 1, max_kv]) with keys j < visible - window also -inf, where
    `visible` counts the keys a query sees (j <= prefix + i: its 0 entries)."""
    visible = (bias == 0).sum(dim=-1, keepdim=True)
    before_window = torch.arange(bias.shape[-1], device=bias.device) < visible - window
    return bias.masked_fill(before_window, float("-inf"))


def windowed_causal_mask(q_len: int, prefix_len: int, window: int, device: torch.device) -> torch.Tensor:
    """Query i (at position prefix_len + i) sees keys prefix_len + i - window + 1 .. prefix_len + i."""
    kv = torch.arange(prefix_len + q_len, device=device)
    qpos = torch.arange(q_len, device=device)[:, None] + prefix_len
    return (kv[None, :] <= qpos) & (kv[None, :] > qpos - window)


def shifted_causal_mask(q_len: int, prefix_len: int, device: torch.device) -> torch.Tensor:
    """Query i (at position prefix_len + i) sees keys 0..prefix_len + i."""
    kv = torch.arange(prefix_len + q_len, device=device)
    qpos = torch.arange(q_len, device=device)[:, None] + prefix_len
    return kv[None, :] <= qpos

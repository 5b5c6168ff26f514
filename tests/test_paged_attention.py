"""Paged attention over ragged batches equals attention over each row's keys, laid out densely.

The metadata comes from the worker's own BatchState (descriptors applied, a prefill
finished, drafts proposed), the pool's pages are shuffled, and the reference is a plain
float64 softmax over each row's keys in order.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.kernels.cpu_kernels import load_decode_attention as load_decode_kernel
from gpu_worker.model.attention import paged_attention
from gpu_worker.model.model_config import ModelConfig
from gpu_worker.runtime.batch_state import MAX_DECODE_GROUPS, BatchState, group_by_length
from gpu_worker.runtime.kv_pool import KVPool
from gpu_worker.runtime.sampler import SamplingTable
from trident.wire.backend import AddedRequest, BatchDescriptor, ExtendChunk, ForwardMode, PageAppends
from trident.wire.codec import pack_int32
from trident.wire.frontend import SamplingParams

pytestmark = pytest.mark.usefixtures("worker_threads")  # the kernels' split across threads is checked too

PAGE = 4
HEAD_DIM = 16


class Batch:
    """A worker batch of rows with given lengths, on a pool whose pages are handed out shuffled."""

    def __init__(self, kv_heads: int, seed: int) -> None:
        self.cfg = ModelConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_layers=1,
            num_heads=4,
            num_kv_heads=kv_heads,
            head_dim=HEAD_DIM,
        )
        self.pool = KVPool(
            self.cfg,
            num_pages=400,
            page_size=PAGE,
            dtype=torch.float32,
            device=torch.device("cpu"),
            num_kv_heads=kv_heads,
        )
        self.pool.kv[0].normal_(generator=torch.Generator().manual_seed(seed))
        self.free_pages = list(np.random.default_rng(seed).permutation(np.arange(1, 400)))
        self.state = BatchState(8, 100, PAGE, SamplingTable(8, 64, [], torch.device("cpu")), torch.device("cpu"))
        self.step = 1
        self.pages = {}

    def send(self, added=(), extends=(), grow: dict[int, int] | None = None):
        appends = []
        for slot, tokens in (grow or {}).items():
            have = len(self.pages.setdefault(slot, []))
            need = -(-tokens // PAGE) - have
            new = [int(self.free_pages.pop()) for _ in range(need)]
            self.pages[slot] += new
            if new:
                appends.append((slot, have, new))
        desc = BatchDescriptor(
            self.step, int(ForwardMode.MIXED), [], list(added), PageAppends.of_rows(appends), list(extends), 0
        )
        self.step += 1
        return self.state.apply(desc)

    def decoding_rows(self, lengths: dict[int, int]) -> None:
        """Rows whose first `length - 1` tokens are cached and whose prefill of one token finishes now."""
        params = SamplingParams(max_new_tokens=8, temperature=0.0)
        added = [AddedRequest(slot, n - 1, params) for slot, n in lengths.items()]
        chunks = self.send(added, [ExtendChunk(s, pack_int32([1]), True) for s in lengths], grow=lengths)
        inputs = self.state.build_forward(chunks)
        self.state.advance(inputs, [np.array([5]) for _ in inputs.sampling_slots])

    def reference(self, q: torch.Tensor, inputs, kv_heads_of: list[int]) -> torch.Tensor:
        """Each computing row's queries against its keys 0..position, float64."""
        kv = self.pool.kv[0].double()
        out = torch.empty_like(q, dtype=torch.float64)
        offset = 0
        for slot, n in zip(inputs.computing_slots.tolist(), inputs.q_lens.tolist()):
            start = int(self.state.row_lens_host[slot])
            total = start + n
            pos = np.arange(total)
            idx = torch.from_numpy(self.state.page_table[slot, pos // PAGE] * PAGE + pos % PAGE)
            keys, values = kv[idx, 0][:, kv_heads_of], kv[idx, 1][:, kv_heads_of]  # [total, heads, dim]
            for i in range(n):
                seen = start + i + 1
                scores = torch.einsum("hd,khd->hk", q[offset + i].double(), keys[:seen]) / HEAD_DIM**0.5
                out[offset + i] = torch.einsum("hk,khd->hd", scores.softmax(-1), values[:seen])
            offset += n
        return out

    def attend(self, inputs, kv_heads_of: list[int], head_map: torch.Tensor | None, kernel=None):
        """Writes this step's new K/V like the model does, then runs paged attention (with
        the C++ decode kernel serving the one-query groups if `kernel`)."""
        gen = torch.Generator().manual_seed(self.step)
        tokens = len(inputs.input_ids)
        kv_heads = self.cfg.num_kv_heads
        q = torch.randn(tokens, len(kv_heads_of), HEAD_DIM, generator=gen)
        k, v = torch.randn(2, tokens, kv_heads, HEAD_DIM, generator=gen)
        self.pool.write(0, inputs.meta.out_cache_loc, k, v)
        inputs.meta.prepare_gather(
            kv_heads, torch.tensor(kv_heads_of if head_map is not None else range(kv_heads)), kernel
        )
        return q, paged_attention(q, k, v, self.pool.kv[0], inputs.meta, head_map, kernel)


@pytest.fixture(params=["torch", "kernel"])
def decode_kernel(request):
    """Decode attention through torch ops, then through the C++ kernel."""
    if request.param == "torch":
        return None
    op = load_decode_kernel()
    assert op is not None, "the paged decode attention kernel did not build"
    return op


@pytest.mark.parametrize("kv_heads, kv_heads_of", [(2, [0, 0, 1, 1]), (1, [0, 0, 0, 0]), (3, [0, 1, 1, 2])])
def test_ragged_decode_verify_and_prefill_rows_equal_dense_attention(kv_heads, kv_heads_of, decode_kernel):
    """Decoding rows of lengths 3..90 (several length groups), rows verifying drafts, a fresh
    prompt and a chunk on top of a cached prefix, in one batch. [0, 1, 1, 2]: heads that
    straddle KV groups, as on a tensor-parallel rank, read through a head map (the kernel
    is never given one: the model keeps the torch path there)."""
    uniform = kv_heads_of == [h // (4 // kv_heads) for h in range(4)]
    head_map = None if uniform else torch.tensor(kv_heads_of)
    kernel = decode_kernel if uniform else None
    batch = Batch(kv_heads, seed=kv_heads)
    decode_lengths = {0: 90, 1: 3, 2: 41, 3: 17, 4: 60}
    batch.decoding_rows(decode_lengths)
    grow = {s: n + 4 for s, n in decode_lengths.items()}
    grow.update({5: 13, 6: 30})
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    added = [AddedRequest(5, 0, params), AddedRequest(6, 21, params)]
    extends = [ExtendChunk(5, pack_int32(range(13)), True), ExtendChunk(6, pack_int32(range(9)), False)]
    chunks = batch.send(added, extends, grow=grow)
    drafts = {2: np.array([7, 8]), 4: np.array([9, 9, 9])}
    inputs = batch.state.build_forward(chunks, drafts)
    assert len(inputs.meta.decode_groups) > 1 and len(inputs.meta.extend_rows) == 2
    q, got = batch.attend(inputs, kv_heads_of, head_map, kernel)
    torch.testing.assert_close(got.double(), batch.reference(q, inputs, kv_heads_of), atol=1e-5, rtol=1e-5)


def test_a_plain_decode_step_uses_the_batch_as_is_and_equals_dense_attention(decode_kernel):
    batch = Batch(2, seed=3)
    lengths = {0: 12, 1: 9, 2: 14}
    batch.decoding_rows(lengths)
    chunks = batch.send(grow={s: n + 1 for s, n in lengths.items()})
    inputs = batch.state.build_forward(chunks)
    (group,) = inputs.meta.decode_groups
    assert group.covers_batch
    q, got = batch.attend(inputs, [0, 0, 1, 1], None, decode_kernel)
    torch.testing.assert_close(got.double(), batch.reference(q, inputs, [0, 0, 1, 1]), atol=1e-5, rtol=1e-5)


def test_with_ragged_decoding_rows_of_any_lengths_decode_as_one_group_through_the_kernel():
    kernel = load_decode_kernel()
    batch = Batch(2, seed=4)
    batch.state.ragged_decode = True
    lengths = {0: 3, 1: 90, 2: 17, 3: 40}  # four length groups without ragged decoding
    assert len(group_by_length(np.array(list(lengths.values())))) == 4
    batch.decoding_rows(lengths)
    chunks = batch.send(grow={s: n + 1 for s, n in lengths.items()})
    inputs = batch.state.build_forward(chunks)
    (group,) = inputs.meta.decode_groups
    assert group.covers_batch and group.kv_lens.tolist() == [n + 1 for n in lengths.values()]
    q, got = batch.attend(inputs, [0, 0, 1, 1], None, kernel)
    torch.testing.assert_close(got.double(), batch.reference(q, inputs, [0, 0, 1, 1]), atol=1e-5, rtol=1e-5)


def test_length_groups_cover_every_row_once_and_at_most_double_the_keys():
    rng = np.random.default_rng(0)
    for _ in range(200):
        lens = rng.integers(1, 2000, rng.integers(1, 40))
        groups = group_by_length(lens)
        assert sorted(i for g in groups for i in g) == list(range(len(lens)))
        assert len(groups) <= MAX_DECODE_GROUPS
        for g in groups[:-1]:
            assert lens[g].max() < 2 * lens[g].min()

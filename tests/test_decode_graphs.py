"""The decode-graph runner (gpu_worker/runtime/decode_graphs.py) on the CPU, without capture:
its padding and its fixed addresses, which a CUDA graph depends on, checked where it runs here.

One in-process worker on a tiny random-weight LLaMA in float32 with `--attention-backend
triton` (the kernels under the Triton interpreter), max 8 rows: buckets 1, 2, 4, 8.
- every input a decode step's forward reads sits at the same address in every step, at any
  row count;
- padding rows write nothing to the KV pool and reach no sampling: after a step of 3 rows
  (bucket 4) the pool differs only at the 3 rows' new slots, and 3 tokens come back;
- its greedy tokens equal those of the torch backend, and of the same kernels unpadded.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported in this process

import tempfile  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from gpu_worker.runtime.decode_graphs import graph_buckets  # noqa: E402
from tests.helpers import TEST_CPU_THREADS, WorkerDriver, make_random_llama  # noqa: E402
from trident.wire.backend import ForwardMode, PageAppends  # noqa: E402
from trident.wire.child import ChildContext  # noqa: E402
from trident.wire.server_args import ServerArgs  # noqa: E402


def _worker(model: str, **flags):
    from gpu_worker.runtime.worker import Worker

    args = ServerArgs(
        model_path=model,
        dtype="float32",
        max_total_tokens=1024,
        max_running_requests=8,
        run_dir=tempfile.mkdtemp(prefix="trident-test-"),
        cpu_threads=TEST_CPU_THREADS,
        **flags,
    )
    ctx = ChildContext(args, "worker", 0)
    return Worker(ctx), ctx


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_random_llama(str(tmp_path_factory.mktemp("llama")), seed=3, scale=0.5)


@pytest.fixture(scope="module")
def triton_worker(model):
    worker, ctx = _worker(model, attention_backend="triton")
    yield worker
    ctx.zmq_ctx.destroy(linger=0)


def test_buckets_are_powers_of_two_up_to_the_max():
    assert graph_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert graph_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert graph_buckets(0) == []


def test_a_decode_steps_inputs_never_move(triton_worker):
    worker = triton_worker
    graphs = worker.decode_graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4, 8] and not graphs.graphs  # CPU: no capture
    seen: list[tuple[int, ...]] = []
    model_forward = worker.model.forward

    def recording_forward(input_ids, positions, kv_pool, meta, logits_indices):
        if not meta.extend_rows:
            (group,) = meta.decode_groups
            tensors = (input_ids, positions, meta.out_cache_loc, group.kv_indices, group.kv_lens, group.kv_rows)
            seen.append(tuple(t.data_ptr() for t in (*tensors, logits_indices)))
        return model_forward(input_ids, positions, kv_pool, meta, logits_indices)

    rng = np.random.default_rng(1)
    worker.model.forward = recording_forward
    try:
        WorkerDriver(worker).generate([rng.integers(100, 5000, 5)], decode_steps=1)  # bucket 1
        WorkerDriver(worker).generate([rng.integers(100, 5000, n) for n in (4, 3, 6)], decode_steps=2)  # bucket 4
    finally:
        del worker.model.forward
    assert len(seen) == 3 and len(set(seen)) == 1, "a decode step's input moved"


def test_padding_rows_write_no_kv_and_reach_no_sampling(triton_worker):
    """3 rows run bucket 4: the pool changes only at the 3 rows' new slots; 3 tokens come back."""
    worker = triton_worker
    driver = WorkerDriver(worker)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(100, 5000, n) for n in (4, 8, 5)]
    slots = range(len(prompts))
    first = driver._send(
        ForwardMode.EXTEND,
        removed_slots=[],
        added=[_added(s) for s in slots],
        page_appends=PageAppends.of_rows([driver._pages(s, len(p)) for s, p in zip(slots, prompts)]),
        extends=[_chunk(s, p) for s, p in zip(slots, prompts)],
    )
    assert len(first) == 3
    before = [kv.clone() for kv in worker.kv_pool.kv]
    new_pages = [driver._pages(s, 1) for s in slots]
    tokens = driver._send(
        ForwardMode.DECODE, removed_slots=[], added=[], page_appends=PageAppends.of_rows(new_pages), extends=[]
    )
    assert len(tokens) == 3
    written = sorted(ids[0] for _, _, ids in new_pages)  # page size 1: a page id is a pool index
    for kv, old in zip(worker.kv_pool.kv, before):
        assert (kv != old).flatten(1).any(dim=1).nonzero().flatten().tolist() == written
    driver._send(ForwardMode.IDLE, removed_slots=list(slots), added=[], page_appends=PageAppends(), extends=[])


def _added(slot: int):
    from trident.wire.backend import AddedRequest
    from trident.wire.frontend import SamplingParams

    return AddedRequest(slot, 0, SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))


def _chunk(slot: int, prompt: np.ndarray):
    from trident.wire.backend import ExtendChunk
    from trident.wire.codec import pack_int32

    return ExtendChunk(slot, pack_int32(prompt), True)


def test_bucketed_steps_sample_what_the_torch_backend_and_unpadded_steps_do(triton_worker, model):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(100, 5000, n) for n in (4, 6, 5)]
    bucketed = WorkerDriver(triton_worker).generate(prompts, decode_steps=2)
    graphs, triton_worker.decode_graphs = triton_worker.decode_graphs, None
    try:
        unpadded = WorkerDriver(triton_worker).generate(prompts, decode_steps=2)
    finally:
        triton_worker.decode_graphs = graphs
    torch_worker, ctx = _worker(model, attention_backend="torch")
    try:
        reference = WorkerDriver(torch_worker).generate(prompts, decode_steps=2)
    finally:
        ctx.zmq_ctx.destroy(linger=0)
    np.testing.assert_array_equal(bucketed, unpadded)
    np.testing.assert_array_equal(bucketed, reference)
    assert len(set(reference[:, 1:].ravel().tolist())) > 1


def test_the_triton_backend_refuses_a_cpu_decode_attention_choice_beside_it():
    from gpu_worker.runtime.worker import resolve_attention_backend

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_attention_backend(ServerArgs(model_path="m"), cpu) == "torch"
    assert resolve_attention_backend(ServerArgs(model_path="m"), cuda) == "triton"
    assert resolve_attention_backend(ServerArgs(model_path="m", attention_backend="triton"), cpu) == "triton"
    with pytest.raises(ValueError, match="--decode-attention kernel"):
        resolve_attention_backend(
            ServerArgs(model_path="m", attention_backend="triton", decode_attention="kernel"), cpu
        )


def test_the_token_table_mirrors_the_page_table_and_keeps_a_columns_last_page():
    from gpu_worker.runtime.batch_state import BatchState
    from gpu_worker.runtime.sampler import SamplingTable
    from trident.wire.backend import AddedRequest, BatchDescriptor

    cpu = torch.device("cpu")
    state = BatchState(4, 3, 2, SamplingTable(4, 100, [0], cpu), cpu)  # page size 2
    table = state.keep_token_table()
    params = _added(0).sampling

    def apply(step: int, pages: list[tuple[int, int, list[int]]], added=(), removed=()) -> None:
        added = [AddedRequest(s, 0, params) for s in added]
        desc = BatchDescriptor(step, int(ForwardMode.IDLE), list(removed), added, PageAppends.of_rows(pages), [], 0)
        state.apply(desc)

    apply(1, [(0, 0, [3, 5]), (2, 0, [7])], added=[0, 2])
    apply(2, [(2, 1, [4])])
    apply(3, [], removed=[2])
    apply(4, [(2, 0, [9])], added=[2])  # slot 2 again: column 0 now holds page 9
    update = state.stage_token_table_updates()
    state.staging.flush()
    update()
    for slot, pages in ((0, [3, 5]), (2, [9, 4])):
        want = [page * 2 + i for page in pages for i in range(2)]
        assert table[slot, : len(want)].tolist() == want
        assert state.pool_index(np.full(len(want), slot), np.arange(len(want))).tolist() == want
    assert state.stage_token_table_updates() is None  # nothing left to write

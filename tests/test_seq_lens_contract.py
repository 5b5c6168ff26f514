"""The seq_lens rules of docs/design.md §4, on the real ScheduleBatch and the real worker BatchState.

Descriptors travel through the real MessagePack codec between the two, the way they do
between the processes; only the model forward is left out (tokens are made up).
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from gpu_worker.runtime.batch_state import BatchState, SeqLensSumMismatch
from gpu_worker.runtime.sampler import SamplingTable
from scheduler_proc.request import Req
from scheduler_proc.schedule_batch import ScheduleBatch, SeqLensDrift, check_seq_lens
from trident.wire.backend import WorkerInput
from trident.wire.codec import FrameEncoder
from trident.wire.frontend import SamplingParams

PAGE = 4


def make_req(rid: str, prompt_len: int, slot: int) -> Req:
    req = Req(rid, np.arange(1, prompt_len + 1, dtype=np.int32), SamplingParams(max_new_tokens=8, temperature=0.0))
    req.slot = slot
    req.pages = list(range(1 + slot * 16, 1 + slot * 16 + 16))
    return req


class Lockstep:
    """A ScheduleBatch and a worker BatchState driven step by step over the wire codec."""

    def __init__(self) -> None:
        self.batch = ScheduleBatch()
        self.worker = BatchState(8, 64, PAGE, SamplingTable(8, 100, [0], torch.device("cpu")), torch.device("cpu"))
        self.step_id = 1
        self._enc = FrameEncoder()
        self._dec = msgspec.msgpack.Decoder(WorkerInput)

    def run_step(self) -> None:
        desc = self._dec.decode(self._enc.encode(self.batch.build_descriptor(self.step_id)))
        self.step_id += 1
        chunks = self.worker.apply(desc)
        inputs = self.worker.build_forward(chunks)
        if inputs is not None:
            self.worker.advance(inputs, [np.array([7]) for _ in inputs.sampling_slots])
        self.worker.check_seq_lens_sum(desc)
        check_seq_lens(self.batch.seq_lens_cpu, self.worker.copy_seq_lens_to_host(for_debug_check=True), desc.step_id)

    def decode_step(self) -> None:
        self.batch.prepare_for_decode(np.asarray([r.decoding for r in self.batch.reqs], dtype=np.int64))
        self.run_step()


def test_merge_batch_invalidates_the_sum():
    b = ScheduleBatch()
    b.refresh_seq_lens_cpu(sync=False)
    req = make_req("a", 10, 0)
    req.prefix_len = 4
    b.merge_batch([req])
    assert b.seq_lens_sum is None
    b.refresh_seq_lens_cpu(sync=False)
    assert b.seq_lens_sum == 4


def test_prepare_for_extend_invalidates_the_sum():
    b = ScheduleBatch()
    b.merge_batch([make_req("a", 10, 0)])
    b.refresh_seq_lens_cpu(sync=False)
    b.prepare_for_extend([(0, 6)])
    assert b.seq_lens_sum is None
    b.refresh_seq_lens_cpu(sync=False)
    assert b.seq_lens_sum == 6


def test_prepare_for_decode_invalidates_the_sum():
    b = ScheduleBatch()
    b.merge_batch([make_req("a", 3, 0), make_req("b", 5, 1)])
    b.prepare_for_extend([(0, 3), (1, 5)])
    b.refresh_seq_lens_cpu(sync=False)
    b.prepare_for_decode(np.asarray([1, 1]))
    assert b.seq_lens_sum is None
    b.refresh_seq_lens_cpu(sync=False)
    assert b.seq_lens_sum == 10


def test_filter_batch_invalidates_the_sum():
    b = ScheduleBatch()
    reqs = [make_req("a", 3, 0), make_req("b", 5, 1)]
    b.merge_batch(reqs)
    b.prepare_for_extend([(0, 3), (1, 5)])
    b.refresh_seq_lens_cpu(sync=False)
    b.filter_batch([reqs[0]])
    assert b.seq_lens_sum is None
    b.refresh_seq_lens_cpu(sync=False)
    assert b.seq_lens_sum == 5


def test_descriptor_build_refreshes_lazily_and_never_sends_none():
    b = ScheduleBatch()
    b.merge_batch([make_req("a", 3, 0)])
    b.prepare_for_extend([(0, 3)])
    assert b.seq_lens_sum is None
    desc = b.build_descriptor(1)
    assert desc.seq_lens_sum == 3 and b.seq_lens_sum == 3


def test_refresh_with_sync_adopts_the_published_lengths():
    b = ScheduleBatch()
    b.merge_batch([make_req("a", 3, 0), make_req("b", 5, 1)])
    b.refresh_seq_lens_cpu(sync=True, published=np.asarray([9, 4], dtype=np.int32))
    assert b.seq_lens_cpu.tolist() == [9, 4] and b.seq_lens_sum == 13
    with pytest.raises(SeqLensDrift):
        b.refresh_seq_lens_cpu(sync=True, published=np.asarray([1], dtype=np.int32))


def test_mirror_matches_the_worker_through_joins_leaves_and_chunks():
    ls = Lockstep()
    a, b, c = make_req("a", 9, 0), make_req("b", 5, 1), make_req("c", 3, 2)
    ls.batch.merge_batch([a, b])
    ls.batch.prepare_for_extend([(0, 4), (1, 5)])  # a is chunked: 4 of 9
    ls.run_step()
    ls.batch.prepare_for_decode(np.asarray([r.decoding for r in ls.batch.reqs], dtype=np.int64))
    ls.batch.prepare_for_extend([(0, 5)])  # a's last chunk rides along b's decode
    ls.run_step()
    ls.decode_step()
    ls.batch.filter_batch([b])
    ls.batch.merge_batch([c])
    ls.batch.prepare_for_decode(np.asarray([r.decoding for r in ls.batch.reqs], dtype=np.int64))
    ls.batch.prepare_for_extend([(1, 3)])
    ls.run_step()
    for _ in range(3):
        ls.decode_step()
    assert ls.batch.seq_lens_cpu.tolist() == [9 + 5, 3 + 3]
    assert ls.worker.seq_lens_d2h_copies == 0  # the plain path never needs the sync copy


def test_skipped_refresh_is_caught_by_check_seq_lens(monkeypatch):
    """A producer that changes seq_lens_cpu but leaves the old sum in place is caught."""
    ls = Lockstep()
    ls.batch.merge_batch([make_req("a", 4, 0)])
    ls.batch.prepare_for_extend([(0, 4)])
    ls.run_step()

    def decode_without_invalidating(self, decode_mask):
        self.seq_lens_cpu += decode_mask  # the bug: seq_lens_sum keeps its stale value

    monkeypatch.setattr(ScheduleBatch, "prepare_for_decode", decode_without_invalidating)
    ls.batch.refresh_seq_lens_cpu(sync=False)
    with pytest.raises(SeqLensSumMismatch):
        ls.decode_step()


def test_skipped_mirror_update_is_caught_by_check_seq_lens(monkeypatch):
    ls = Lockstep()
    ls.batch.merge_batch([make_req("a", 4, 0)])
    ls.batch.prepare_for_extend([(0, 4)])
    ls.run_step()
    monkeypatch.setattr(ScheduleBatch, "prepare_for_decode", lambda self, mask: None)
    with pytest.raises((SeqLensDrift, SeqLensSumMismatch)):
        ls.decode_step()

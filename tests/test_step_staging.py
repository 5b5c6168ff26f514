"""The pinned, non-blocking metadata path (gpu_worker/runtime/host_staging.py), run on the CPU.

On CPU the staging buffers are the device buffers, so these tests check what does not
depend on the device: views hold the staged values, the count of copies a GPU would make
stays a few per step whatever the batch size, a step makes no per-field copy to the device
(every crossing the worker's step makes is audited with a TorchFunctionMode), the seq_lens
publish is one counted copy, and seeded sampling is vectorised yet batch-independent.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.runtime.batch_state import BatchState
from gpu_worker.runtime.host_staging import DeviceToHost, StepStaging
from gpu_worker.runtime.sampler import SamplingTable, sample
from gpu_worker.runtime.transfer_audit import TransferAudit
from trident.wire.backend import AddedRequest, BatchDescriptor, ExtendChunk, ForwardMode, PageAppends
from trident.wire.codec import pack_int32
from trident.wire.frontend import SamplingParams

PAGE = 4
VOCAB = 64


def test_staged_views_hold_their_values_after_one_flush_per_dtype():
    staging = StepStaging("cpu")
    staging.begin_step()
    a = staging.stage(np.arange(5), torch.int64)
    b = staging.stage(np.arange(6).reshape(2, 3), torch.int64, (2, 3))
    c = staging.stage([0.5, -1.0], torch.float32)
    staging.flush()
    assert a.tolist() == [0, 1, 2, 3, 4]
    assert b.tolist() == [[0, 1, 2], [3, 4, 5]] and b.is_contiguous()
    assert c.tolist() == [0.5, -1.0]
    assert staging.transfers == 2 and staging.staged_arrays == 3


def test_a_buffer_outgrown_mid_step_keeps_the_views_already_handed_out():
    staging = StepStaging("cpu")
    staging.begin_step()
    small = staging.stage(np.arange(10), torch.int64)
    big = staging.stage(np.arange(100_000), torch.int64)  # past the initial buffer
    staging.flush()
    assert small.tolist() == list(range(10))
    assert int(big[-1]) == 99_999
    assert staging.transfers == 2  # the outgrown buffer's tail and the new one's


def test_device_to_host_returns_a_copy_that_the_next_fetch_does_not_overwrite():
    readback = DeviceToHost("cpu")
    first = readback.fetch(torch.tensor([1, 2, 3]))
    readback.fetch(torch.tensor([7, 8, 9]))
    assert first.tolist() == [1, 2, 3] and readback.copies == 2


class Rows:
    """A worker BatchState of `n` decoding rows of different lengths."""

    def __init__(self, n: int) -> None:
        self.state = BatchState(n, 32, PAGE, SamplingTable(n, VOCAB, [0], torch.device("cpu")), torch.device("cpu"))
        self.step = 1
        self.lens = [3 + 3 * i for i in range(n)]
        params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
        added = [AddedRequest(s, 0, params) for s in range(n)]
        pages = PageAppends.of_rows((s, 0, list(range(1 + 32 * s, 1 + 32 * s + 32))) for s in range(n))
        extends = [ExtendChunk(s, pack_int32(np.arange(1, ln + 1) % VOCAB), True) for s, ln in enumerate(self.lens)]
        self.run(ForwardMode.EXTEND, added=added, page_appends=pages, extends=extends)

    def run(self, mode: ForwardMode, **fields) -> None:
        fields = {"removed_slots": [], "added": [], "page_appends": PageAppends(), "extends": []} | fields
        desc = BatchDescriptor(self.step, int(mode), seq_lens_sum=0, **fields)
        self.step += 1
        inputs = self.state.build_forward(self.state.apply(desc))
        self.state.advance(inputs, [np.array([5]) for _ in inputs.sampling_slots])

    def decode(self) -> None:
        self.run(ForwardMode.DECODE)


def transfers_per_decode_step(rows: Rows, steps: int = 4) -> float:
    before = rows.state.staging.transfers
    for _ in range(steps):
        rows.decode()
    return (rows.state.staging.transfers - before) / steps


def test_a_decode_step_makes_as_many_transfers_at_one_row_as_at_sixteen():
    one, sixteen = transfers_per_decode_step(Rows(1)), transfers_per_decode_step(Rows(16))
    # The forward's metadata (int64, bool, float32) and the advance (int64): one copy each.
    assert one == sixteen <= 4


def test_a_decode_step_sends_nothing_to_the_device_outside_the_staging():
    rows = Rows(8)
    rows.decode()
    with TransferAudit() as audit:
        for _ in range(3):
            rows.decode()
    assert audit.blocking_to_device == 0, audit.calls
    assert audit.host_reads == 0, audit.calls


def test_the_seq_lens_publish_is_one_counted_non_blocking_copy():
    rows = Rows(4)
    rows.decode()
    with TransferAudit() as audit:
        host = rows.state.copy_seq_lens_to_host()
    assert host.tolist() == [ln + 1 for ln in rows.lens]  # the prompt, then the token one decode step fed
    assert rows.state.seq_lens_d2h_copies == 1 and rows.state.readback.copies == 1
    assert audit.non_blocking_copies == 1 and audit.blocking_copies == 0, audit.calls


def seeded_tokens(batch_seeds: list[int | None], steps: int) -> list[list[int]]:
    """Tokens each row draws at temperature 1 over `steps` steps of the same logits."""
    n = len(batch_seeds)
    table = SamplingTable(n, VOCAB, [0], torch.device("cpu"))
    for slot, seed in enumerate(batch_seeds):
        table.add(slot, SamplingParams(temperature=1.0, seed=seed, max_new_tokens=steps), [])
    logits = torch.zeros(n, VOCAB)
    out = [[] for _ in range(n)]
    for _ in range(steps):
        tokens, _ = sample(logits, list(range(n)), table)
        for row, t in enumerate(tokens.tolist()):
            out[row].append(t)
    return out


def test_a_seeded_row_draws_the_same_tokens_alone_and_among_others():
    alone = seeded_tokens([1234], 12)[0]
    crowded = seeded_tokens([None, 99, 1234, None], 12)
    assert crowded[2] == alone
    assert crowded[1] != alone  # another seed draws otherwise
    assert len(set(alone)) > 3  # uniform logits: the draws spread over the vocabulary


def test_sampling_a_mixed_batch_launches_no_op_per_row():
    """The op count of a step of mixed settings does not grow with the rows."""

    def ops(n: int) -> int:
        table = SamplingTable(n, VOCAB, [0], torch.device("cpu"))
        for slot in range(n):
            params = SamplingParams(
                temperature=0.5 + slot % 2,
                top_k=3 + slot,
                seed=slot if slot % 2 else None,
                min_new_tokens=4,
                max_new_tokens=8,
            )
            table.add(slot, params, [])
        logits = torch.randn(n, VOCAB)
        with TransferAudit() as audit:
            sample(logits, list(range(n)), table)
        return audit.torch_calls

    assert ops(2) == ops(12)

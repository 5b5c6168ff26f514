"""The wire is plain MessagePack, decoding is validation, and bad frames are dropped."""

from __future__ import annotations

import os

import msgpack
import msgspec
import numpy as np
import pytest
import zmq

from tests.helpers import wait_until
from tests.test_process_lifecycle import run_dir_of
from trident.wire.backend import (
    AddedRequest,
    BatchDescriptor,
    ExtendChunk,
    PageAppends,
    SchedulerReply,
    StepResult,
    WorkerCounters,
    WorkerInput,
)
from trident.wire.codec import FrameDecoder, FrameEncoder, pack_int32, unpack_int32
from trident.wire.control import ProtocolMismatch, check_protocol_version
from trident.wire.frontend import (
    GenerateReq,
    RowExtras,
    SamplingParams,
    SchedulerInput,
    TokenizerInput,
    TokenOutBatch,
)
from trident.wire.transport import scheduler_in_endpoint, worker_endpoint


def sample_descriptor() -> BatchDescriptor:
    return BatchDescriptor(
        step_id=7,
        forward_mode=3,
        removed_slots=[2],
        added=[AddedRequest(slot=4, prefix_len=16, sampling=SamplingParams(max_new_tokens=32, temperature=0.7))],
        page_appends=PageAppends.of_rows([(4, 0, [5, 6, 7])]),
        extends=[ExtendChunk(slot=4, token_ids=pack_int32([101, 102, 103]), is_last=True)],
        seq_lens_sum=123,
    )


def test_every_frame_kind_is_plain_msgpack():
    enc = FrameEncoder()
    frames = [
        enc.encode(sample_descriptor()),
        enc.encode(GenerateReq("r1", pack_int32([1, 2, 3]), SamplingParams(max_new_tokens=4))),
        enc.encode(TokenOutBatch(["r1"], pack_int32([5, 6]), pack_int32([2]), [RowExtras(0, "stop", cached_tokens=3)])),
        enc.encode(StepResult(7, pack_int32([9]), WorkerCounters(steps=1), 0.01)),
    ]
    desc = msgpack.unpackb(frames[0], raw=False)
    assert desc[0] == "batch" and desc[1] == 7 and desc[-1] == 123
    page_ids = desc[5][2]
    assert np.frombuffer(page_ids, dtype="<i4").tolist() == [5, 6, 7]
    gen = msgpack.unpackb(frames[1], raw=False)
    assert gen[:2] == ["generate", "r1"] and np.frombuffer(gen[2], dtype="<i4").tolist() == [1, 2, 3]
    tokens = msgpack.unpackb(frames[2], raw=False)
    assert tokens[:2] == ["tokens", ["r1"]] and np.frombuffer(tokens[2], dtype="<i4").tolist() == [5, 6]
    assert msgpack.unpackb(frames[3], raw=False)[0] == "result"


def test_token_ids_travel_as_zero_copy_int32():
    data = pack_int32(np.arange(1000))
    view = unpack_int32(data)
    assert view.dtype == np.dtype("<i4") and not view.flags.writeable and view[-1] == 999


def test_decoder_drops_and_counts_malformed_frames():
    dec = FrameDecoder(WorkerInput, "test")
    assert dec.decode(b"\xc1garbage") is None
    assert dec.decode(msgpack.packb(["batch", "not-an-int"])) is None
    assert dec.decode(msgpack.packb(["no-such-tag", 1])) is None
    assert dec.dropped == 3
    assert dec.decode(FrameEncoder().encode(sample_descriptor())) == sample_descriptor()


def test_protocol_version_mismatch_is_a_clear_error():
    with pytest.raises(ProtocolMismatch, match="protocol v999"):
        check_protocol_version("worker[tp0]", 999)


def test_no_pickle_anywhere_in_the_code():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for pkg in ["wire", "tokenizer_proc", "scheduler_proc", "gpu_worker"]:
        for dirpath, _, files in os.walk(os.path.join(root, pkg)):
            for f in files:
                if f.endswith(".py"):
                    text = open(os.path.join(dirpath, f)).read()
                    assert "import pickle" not in text and "send_pyobj" not in text and "recv_pyobj" not in text


def test_malformed_frames_sent_to_live_processes_are_dropped_and_serving_continues(smollm2_server):
    run_dir = run_dir_of(smollm2_server)
    ctx = zmq.Context()
    try:
        for name in [scheduler_in_endpoint(0), worker_endpoint(0, 0)]:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(f"ipc://{os.path.join(run_dir, name)}")
            sock.send(os.urandom(64))
            sock.send(msgpack.packb(["generate", 1, 2, 3]))
            sock.send(msgpack.packb({"not": "a struct"}))
            sock.close()
    finally:
        ctx.term()
    client = smollm2_server.client()
    for _ in range(2):  # the worker reports its drops with the steps that follow them
        res = client.completions.create(
            model="smollm2-135m", prompt="The capital of France is", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert res.usage.completion_tokens == 4
    http = smollm2_server.http()
    assert wait_until(lambda: http.get("/server_info").json()["scheduler_stats"]["dropped_frames"] >= 6, 10)


def test_decoding_is_validation_for_each_socket_union():
    for union in [SchedulerInput, SchedulerReply, WorkerInput]:
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(msgpack.packb(["batch", 1]), type=union)


def test_token_out_batch_round_trips_rows_with_and_without_extras():
    batch = TokenOutBatch(
        ["a", "b", "c"],
        pack_int32([11, 21, 22, 23]),
        pack_int32([1, 3, 0]),
        [RowExtras(1, "stop", cached_tokens=4), RowExtras(2, "abort")],
    )
    decoded = FrameDecoder(TokenizerInput, "test").decode(FrameEncoder().encode(batch))
    assert decoded == batch
    rows = list(decoded.rows())
    assert [(rid, tokens) for rid, tokens, _ in rows] == [("a", [11]), ("b", [21, 22, 23]), ("c", [])]
    assert rows[0][2] is None and rows[1][2].finish_reason == "stop" and rows[1][2].cached_tokens == 4
    assert rows[2][2].finish_reason == "abort"


def test_a_decode_step_is_one_token_per_row_without_counts_or_extras():
    batch = TokenOutBatch(["a", "b"], pack_int32([7, 8]))
    assert [(rid, tokens, extras) for rid, tokens, extras in batch.rows()] == [("a", [7], None), ("b", [8], None)]
    plain = msgpack.unpackb(FrameEncoder().encode(batch), raw=False)
    assert plain[:2] == ["tokens", ["a", "b"]]


@pytest.mark.parametrize(
    "columns",
    [
        [["a", "b"], pack_int32([1])],  # one token for two one-token rows
        [["a"], pack_int32([1, 2]), pack_int32([1])],  # counts do not add up
        [["a", "b"], pack_int32([1, 2]), pack_int32([2])],  # one count for two rows
        [["a"], pack_int32([1]), pack_int32([-1, 2])],  # a negative count
        [["a"], b"\x01\x00"],  # token bytes that are not int32
        [["a"], pack_int32([1]), b"", [[5, "stop"]]],  # extras for a row that does not exist
    ],
)
def test_token_out_batch_whose_columns_disagree_is_dropped_and_counted(columns):
    dec = FrameDecoder(TokenizerInput, "test")
    assert dec.decode(msgpack.packb(["tokens", *columns])) is None
    assert dec.dropped == 1


def test_page_appends_round_trip_and_scatter_each_rows_pages_into_its_slot():
    desc = sample_descriptor()
    desc.page_appends = PageAppends.of_rows([(4, 0, [5, 6, 7]), (2, 3, [9]), (1, 1, [])])
    decoded = FrameDecoder(WorkerInput, "test").decode(FrameEncoder().encode(desc))
    slots, cols, ids = decoded.page_appends.scatter_indices()
    assert list(zip(slots.tolist(), cols.tolist(), ids.tolist())) == [(4, 0, 5), (4, 1, 6), (4, 2, 7), (2, 3, 9)]
    one_each = PageAppends.of_rows([(0, 10, [3]), (5, 2, [8])])
    assert one_each.counts == b""  # the decode step at page size 1 sends no counts
    slots, cols, ids = one_each.scatter_indices()
    assert list(zip(slots.tolist(), cols.tolist(), ids.tolist())) == [(0, 10, 3), (5, 2, 8)]


@pytest.mark.parametrize(
    "columns",
    [
        [pack_int32([1, 2]), pack_int32([0]), pack_int32([5, 6])],  # two slots, one first index
        [pack_int32([1]), pack_int32([0]), pack_int32([5, 6])],  # two pages, no counts: one row each
        [pack_int32([1]), pack_int32([0]), pack_int32([5, 6]), pack_int32([3])],  # counts do not add up
        [pack_int32([1]), pack_int32([0]), b"\x05"],  # page ids that are not int32
    ],
)
def test_descriptor_whose_page_append_columns_disagree_is_dropped_and_counted(columns):
    frame = msgpack.unpackb(FrameEncoder().encode(sample_descriptor()), raw=False)
    frame[5] = columns
    dec = FrameDecoder(WorkerInput, "test")
    assert dec.decode(msgpack.packb(frame)) is None
    assert dec.dropped == 1

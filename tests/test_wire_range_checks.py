"""Every index off the wire is range-checked before it touches memory: a descriptor with an
out-of-range slot, page id, length or token is refused whole by the worker, and a step result
whose tokens do not fit its step is refused by the scheduler. Refused and counted, never an
out-of-bounds read, never a truncation, no process restarted, no request left waiting. A
request frame the scheduler cannot read ends its request with an error, when it names one."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
import zmq

from gpu_worker.runtime.batch_state import BatchState, DescriptorOutOfRange
from gpu_worker.runtime.sampler import SamplingTable
from scheduler_proc.output import result_mismatch
from tests.helpers import running_server, wait_until, write_sim_profile
from tests.test_simulated_worker import completions, sim_args
from trident.wire.backend import (
    AddedRequest,
    BatchDescriptor,
    ExtendChunk,
    ForwardMode,
    PageAppends,
    StepResult,
    WorkerCounters,
)
from trident.wire.codec import FrameDecoder, FrameEncoder, UnreadableRequest, pack_int32
from trident.wire.frontend import AbortReq, GenerateReq, SamplingParams, SchedulerInput
from trident.wire.transport import scheduler_in_endpoint, scheduler_reply_endpoint, worker_endpoint

SLOTS, PAGES_PER_ROW, PAGE, VOCAB, POOL_PAGES = 4, 8, 2, 100, 32
FORGED_STEP = 10**6
"""A step id no scheduler sends: the frame is about no step in flight."""


def state_with_one_row() -> BatchState:
    """Slot 1 decoding at length 3, its pages 5 and 6."""
    state = BatchState(SLOTS, PAGES_PER_ROW, PAGE, SamplingTable(SLOTS, VOCAB, [0], torch.device("cpu")), "cpu")
    state.num_pages = POOL_PAGES
    state.apply(
        BatchDescriptor(
            1,
            ForwardMode.EXTEND,
            [],
            [AddedRequest(1, 0, SamplingParams(8))],
            PageAppends.of_rows([(1, 0, [5, 6])]),
            [ExtendChunk(1, pack_int32([7, 8, 9]), True)],
            0,
        )
    )
    state.decoding[1] = True
    state.row_lens_host[1] = 3
    return state


def desc(**changes) -> BatchDescriptor:
    fields = dict(
        step_id=2,
        forward_mode=ForwardMode.DECODE,
        removed_slots=[],
        added=[],
        page_appends=PageAppends(),
        extends=[],
        seq_lens_sum=3,
    )
    return BatchDescriptor(**(fields | changes))


FORGED_DESCRIPTORS = {
    "removed slot past the table": desc(removed_slots=[SLOTS]),
    "removed slot not in the batch": desc(removed_slots=[2]),
    "negative added slot": desc(added=[AddedRequest(-1, 0, SamplingParams(8))]),
    "added slot already in the batch": desc(added=[AddedRequest(1, 0, SamplingParams(8))]),
    "prefix past the page table": desc(added=[AddedRequest(2, PAGES_PER_ROW * PAGE + 1, SamplingParams(8))]),
    "page id past the pool": desc(page_appends=PageAppends.of_rows([(1, 2, [POOL_PAGES])])),
    "negative page id": desc(page_appends=PageAppends.of_rows([(1, 2, [-3])])),
    "page-table column past the row": desc(page_appends=PageAppends.of_rows([(1, PAGES_PER_ROW, [4])])),
    "pages for a slot not in the batch": desc(page_appends=PageAppends.of_rows([(3, 0, [4])])),
    "chunk for a slot not in the batch": desc(extends=[ExtendChunk(3, pack_int32([1]), True)]),
    "prompt token past the vocabulary": desc(
        added=[AddedRequest(2, 0, SamplingParams(8))], extends=[ExtendChunk(2, pack_int32([VOCAB]), True)]
    ),
    "stop token past the vocabulary": desc(added=[AddedRequest(2, 0, SamplingParams(8, stop_token_ids=[VOCAB]))]),
    "biased token past the vocabulary": desc(added=[AddedRequest(2, 0, SamplingParams(8, logit_bias=[(VOCAB, 1.0)]))]),
    "negative allowed token": desc(added=[AddedRequest(2, 0, SamplingParams(8, allowed_token_ids=[-1]))]),
    "bad word past the vocabulary": desc(added=[AddedRequest(2, 0, SamplingParams(8, bad_words_ids=[[1, VOCAB]]))]),
    "chunk past the page table": desc(
        added=[AddedRequest(2, 0, SamplingParams(8))],
        extends=[ExtendChunk(2, pack_int32([1] * (PAGES_PER_ROW * PAGE + 1)), True)],
    ),
}


@pytest.mark.parametrize("forged", FORGED_DESCRIPTORS.values(), ids=FORGED_DESCRIPTORS.keys())
def test_an_out_of_range_descriptor_is_refused_before_it_changes_anything(forged):
    state = state_with_one_row()
    before = (state.page_table.copy(), state.row_lens_host.copy(), list(state.order), state.next_step_id)
    with pytest.raises(DescriptorOutOfRange):
        state.apply(forged)
    after = (state.page_table, state.row_lens_host, state.order, state.next_step_id)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    state.apply(desc(page_appends=PageAppends.of_rows([(1, 2, [7])])))  # the real next step still applies
    assert state.page_table[1, 2] == 7


def test_a_decoding_row_at_the_end_of_its_page_table_cannot_step_past_it():
    state = state_with_one_row()
    state.row_lens_host[1] = PAGES_PER_ROW * PAGE
    with pytest.raises(DescriptorOutOfRange, match="KV length after the step"):
        state.apply(desc())


def result(tokens: list[int], accept: list[int] | None = None, logprobs: int = 0) -> StepResult:
    return StepResult(
        1, pack_int32(tokens), WorkerCounters(), 0.0, [None] * logprobs, pack_int32(accept) if accept else b""
    )


def test_a_step_result_must_fit_its_step_exactly():
    assert result_mismatch(3, 4, result([1, 2, 3]), 1) is None
    assert "2 tokens for 3 sampling rows" in result_mismatch(3, 4, result([1, 2]), 1)
    assert "4 tokens for 3" in result_mismatch(3, 4, result([1, 2, 3, 4]), 1)
    assert result_mismatch(2, 2, result([1, 2, 3, 4], accept=[1, 3]), 5) is None
    assert "accept lengths summing to 5" in result_mismatch(2, 2, result([1, 2, 3, 4], accept=[2, 3]), 5)
    assert "accept length outside 1..3" in result_mismatch(2, 2, result([1, 2, 3, 4], accept=[0, 4]), 3)
    assert "1 accept lengths for 2" in result_mismatch(2, 2, result([1], accept=[1]), 3)
    assert "logprob rows" in result_mismatch(2, 2, result([1, 2], logprobs=1), 1)


def send_frames(address: str, frames: list[bytes]) -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(address)
        for frame in frames:
            sock.send(frame)
        sock.close()
    finally:
        ctx.term()


def test_forged_descriptors_and_short_step_results_are_refused_and_counted_on_a_live_server(tmp_path):
    # 40 ms a step: each step stays in flight long enough for a forged result to name it.
    profile = write_sim_profile(str(tmp_path / "profile.json"), const_s=0.04)
    with running_server(sim_args(profile)) as server:
        http = server.http()
        run_dir = http.get("/server_info").json()["run_dir"]
        pids = {p.pid for p in server.process_tree()}
        enc = FrameEncoder()
        forged = [enc.encode(d) for d in live_forgeries()]
        # Before any request, while the worker's batch is empty: a finished request's slot stays
        # in it until the next step's descriptor removes it, and a forged row added on that slot
        # would be refused as a duplicate before its out-of-range field is looked at.
        send_frames(f"ipc://{os.path.join(run_dir, worker_endpoint(0, 0))}", forged)
        # The server's output is read by a thread, which a loaded host can leave a little behind.
        assert wait_until(lambda: "".join(server.output).count("is outside [") >= len(forged), 10), server.log_tail()
        expected = completions(server, stream=False)

        done = threading.Event()

        def forge_short_results() -> None:
            """Zero tokens for each of the next steps, again and again, while requests run."""
            address = f"ipc://{os.path.join(run_dir, scheduler_reply_endpoint(0))}"
            while not done.is_set():
                steps = http.get("/server_info").json()["scheduler_stats"]["steps"]
                send_frames(address, [enc.encode(result_for(steps + k)) for k in range(1, 30)])
                time.sleep(0.02)

        with ThreadPoolExecutor(1) as pool:
            forging = pool.submit(forge_short_results)
            try:
                assert completions(server, stream=True) == expected
            finally:
                done.set()
            forging.result()
        assert {p.pid for p in server.process_tree()} == pids  # nothing died, nothing restarted
        assert "refusing the result of step" in "".join(server.output)
        assert completions(server, stream=False) == expected  # the worker's state was never touched
        stats = http.get("/server_info").json()["scheduler_stats"]
        assert stats["dropped_frames"] >= 2 * len(forged)  # the worker's refusals and their ignored replies
        # Statistics are published every half second: wait for the last of them.
        assert wait_until(lambda: http.get("/server_info").json()["scheduler_stats"]["running_requests"] == 0, 5)


def live_forgeries() -> list[BatchDescriptor]:
    """Out-of-range values for a server that has run no request yet (an empty batch), under a
    step id it never sends."""
    row = [AddedRequest(0, 0, SamplingParams(8))]
    return [
        desc(step_id=FORGED_STEP, removed_slots=[10**6]),
        desc(step_id=FORGED_STEP, added=[AddedRequest(-1, 0, SamplingParams(8))]),
        desc(step_id=FORGED_STEP, added=[AddedRequest(0, 10**8, SamplingParams(8))]),
        desc(step_id=FORGED_STEP, added=row, page_appends=PageAppends.of_rows([(0, 0, [2**30])])),
        desc(step_id=FORGED_STEP, added=row, page_appends=PageAppends.of_rows([(0, 10**6, [1])])),
        desc(step_id=FORGED_STEP, added=row, extends=[ExtendChunk(0, pack_int32([10**8]), True)]),
    ]


def result_for(step_id: int) -> StepResult:
    return StepResult(step_id, b"", WorkerCounters(), 0.0)


def test_a_malformed_request_frame_that_names_its_request_ends_that_request_with_an_error(tmp_path):
    """A request frame the scheduler cannot read (here a float where an int belongs) is dropped
    and counted, and if it names its request, that request ends with an error: its client is
    answered at once, not left waiting for output that will never come."""
    profile = write_sim_profile(str(tmp_path / "profile.json"), const_s=0.05)
    with running_server(sim_args(profile)) as server:
        http = server.http()
        run_dir = http.get("/server_info").json()["run_dir"]
        pids = {p.pid for p in server.process_tree()}
        body = {"text": "Tell me everything.", "rid": "victim", "sampling_params": {"max_new_tokens": 400}}
        body["sampling_params"]["ignore_eos"] = True
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(lambda: httpx.post(f"{server.base_url}/generate", json=body, timeout=60))
            assert wait_until(lambda: http.get("/server_info").json()["tokenizer_stats"]["open_requests"] == 1, 10)
            unreadable = GenerateReq("victim", pack_int32([5, 6, 7]), SamplingParams(8, top_k=1.5))
            send_frames(f"ipc://{os.path.join(run_dir, scheduler_in_endpoint(0))}", [FrameEncoder().encode(unreadable)])
            answer = waiting.result(timeout=30)
        assert answer.status_code == 500 and "could not read this request" in answer.text, answer.text
        assert "Expected `int`, got `float`" in answer.text
        assert {p.pid for p in server.process_tree()} == pids
        assert wait_until(lambda: http.get("/server_info").json()["scheduler_stats"]["dropped_frames"] >= 1, 5)
        assert completions(server, stream=False)  # the server serves on


def test_only_an_answerable_tag_with_a_request_id_comes_back_as_unreadable():
    frame = FrameEncoder().encode(GenerateReq("r1", b"", SamplingParams(8, top_k=1.5)))
    answering = FrameDecoder(SchedulerInput, "test", frozenset({"generate"}))
    unreadable = answering.decode(frame)
    assert isinstance(unreadable, UnreadableRequest) and unreadable.rid == "r1" and "Expected `int`" in unreadable.why
    assert FrameDecoder(SchedulerInput, "test").decode(frame) is None
    assert answering.decode(FrameEncoder().encode(AbortReq(7))) is None  # malformed, but not answerable
    assert answering.decode(b"\xc1 not msgpack") is None
    assert answering.decode(b"\x91" * 100_000) is None  # nested past msgspec's depth
    assert answering.dropped == 4

"""The scheduler's own CPU per decode step, in-process: no sockets, no worker, no tokenizer.

The real `Scheduler` runs its overlap loop (schedule, launch, process the previous result)
against an in-memory stand-in for its sockets that encodes every frame it is given, as the
real sockets do, and answers each step at once with the `SeqLensSync` and `StepResult` a
worker would send (one made-up token per sampling row). What is left is the scheduler's
Python and the MessagePack encoding: the per-row cost that grows with the batch.

    python benchmarks/bench_scheduler_step.py --running 8,64,256,1024 [--profile 256]

Reports process CPU time (user + system) per steady decode step; `--profile N` prints
cProfile's top functions for N rows instead.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import time
from collections import deque
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scheduler_proc.prefill import WaitingQueue  # noqa: E402
from scheduler_proc.scheduler import Scheduler  # noqa: E402
from scheduler_proc.stats import SchedulerCounters  # noqa: E402
from scheduler_proc.worker_link import Step, WorkerLink  # noqa: E402
from trident.wire.backend import SeqLensSync, StepResult, WorkerCounters, WorkerReady  # noqa: E402
from trident.wire.codec import FrameEncoder, pack_int32  # noqa: E402
from trident.wire.frontend import GenerateReq, SamplingParams  # noqa: E402
from trident.wire.server_args import ServerArgs  # noqa: E402


class _Sink:
    """A push socket that encodes and counts, like the real one, and sends nowhere."""

    def __init__(self) -> None:
        self.encoder = FrameEncoder()
        self.bytes = 0

    def send(self, msg: Any) -> None:
        self.bytes += len(self.encoder.encode(msg))


class FakeIO:
    """SchedulerIO's surface, in memory; each launched step is answered at once."""

    def __init__(self) -> None:
        self.tokenizer = _Sink()
        self.requests = SimpleNamespace(recv_nowait=list, recv=lambda timeout_ms=None: None)
        self.replies: deque[Any] = deque()
        self.recorder = None
        self.last_descriptor_bytes = 0
        self.dropped_frames = 0
        self.rejected_frames = 0
        self._encoder = FrameEncoder()

    def send_to_workers(self, desc: Any) -> None:
        self.last_descriptor_bytes = len(self._encoder.encode(desc))

    def record_result(self, result: Any) -> None:
        pass


class AnsweringLink(WorkerLink):
    """A worker link whose worker answers every step as it is sent."""

    def send(self, step: Step) -> None:
        super().send(step)
        before = step.expected_seq_lens - step.increments
        tokens = pack_int32(np.full(len(step.sampling_reqs), 7, dtype=np.int32))
        step_id = step.descriptor.step_id
        self.io.replies.append(SeqLensSync(step_id, pack_int32(before), int(before.sum())))
        self.io.replies.append(StepResult(step_id, tokens, WorkerCounters(), 0.0))

    def next_reply(self) -> Any:
        return self.io.replies.popleft()


class InProcessScheduler(Scheduler):
    """The real scheduler with FakeIO and AnsweringLink."""

    def __init__(self, args: ServerArgs, num_pages: int) -> None:
        self.ctx = SimpleNamespace(args=args, dp_rank=0, tell_launcher=print)
        self.args = args
        self.boot_id = "bench"
        self.io = FakeIO()
        self.reqs = {}
        self.tokenizer_pid = None
        self.num_draft_tokens = 0
        self.waiting = WaitingQueue(args.schedule_policy)
        self.counters = SchedulerCounters(self)
        self.install_workers(WorkerReady(1, 0, num_pages, args.page_size, 32000, 1 << 20, [2], 1 << 16))

    def install_workers(self, ready: WorkerReady) -> None:
        super().install_workers(ready)
        self.link = AnsweringLink(self.ctx, self.io, self.counters, self.handle_requests)

    def one_step(self) -> None:
        """One turn of event_loop_overlap (no requests arrive)."""
        step = self.schedule_step()
        if step is not None:
            self.launch(step)
        if len(self.link.in_flight) > (1 if step is not None else 0):
            self.process_result(*self.link.wait_result())


def make_scheduler(running: int, prompt_len: int, page_size: int) -> InProcessScheduler:
    args = ServerArgs(model_path="none", max_running_requests=running, page_size=page_size, max_prefill_tokens=1 << 20)
    sched = InProcessScheduler(args, num_pages=running * 4096 // page_size + 2)
    sp = SamplingParams(max_new_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    for i in range(running):
        ids = pack_int32(np.arange(prompt_len, dtype=np.int32) + 1000 + i * prompt_len)
        sched.handle_generate(GenerateReq(f"req-{i:032x}", ids, sp))
    for _ in range(8):  # admission and prefill, then steady decode
        sched.one_step()
    assert len(sched.batch.reqs) == running and all(r.decoding for r in sched.batch.reqs)
    return sched


def cpu_s() -> float:
    return time.process_time()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", default="8,64,256,1024")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--profile", type=int, default=0, help="cProfile this many rows instead")
    ns = p.parse_args(argv)
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)  # as scheduler_proc/__main__.py sets it
    if ns.profile:
        sched = make_scheduler(ns.profile, ns.prompt_len, ns.page_size)
        prof = cProfile.Profile()
        prof.runcall(lambda: [sched.one_step() for _ in range(ns.steps)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return 0
    print(f"load average (1 min): {os.getloadavg()[0]:.2f}")
    for n in (int(x) for x in ns.running.split(",")):
        sched = make_scheduler(n, ns.prompt_len, ns.page_size)
        c0, t0 = cpu_s(), time.perf_counter()
        for _ in range(ns.steps):
            sched.one_step()
        c1, t1 = cpu_s(), time.perf_counter()
        print(
            f"running {n:5d}: scheduler CPU {(c1 - c0) / ns.steps * 1e3:.3f} ms/step "
            f"(wall {(t1 - t0) / ns.steps * 1e3:.3f} ms), descriptor {sched.io.last_descriptor_bytes} B, "
            f"token outputs {sched.io.tokenizer.bytes / ns.steps:.0f} B/step"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

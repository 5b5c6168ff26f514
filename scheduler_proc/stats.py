"""Scheduler counters: the periodic SchedulerStats frame and the "Decode batch" log line."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import msgspec

from trident.wire.backend import WorkerCounters
from trident.wire.frontend import SchedulerStats

if TYPE_CHECKING:
    from scheduler_proc.scheduler import Scheduler
    from scheduler_proc.worker_link import Step
    from trident.wire.backend import StepResult

logger = logging.getLogger("scheduler_proc")

PUBLISH_INTERVAL_S = 0.5
LOG_INTERVAL_S = 10.0


class SchedulerCounters:
    """Owns the scheduler's counters; publishes them as a `SchedulerStats` frame."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.totals = SchedulerStats()
        """The statistics this scheduler counts itself (tokens, steps, retractions, resumed
        requests, speculation...); `snapshot` fills in the rest from the scheduler's state."""
        self.seq_lens_syncs = 0
        self.ignored_replies = 0
        """Worker replies about no step in flight (stale after a restart, or forged)."""
        self.refused_results = 0
        """Step results that do not fit the step they name, or name a later step than the
        oldest in flight (worker_link.py): refused, never used."""
        self.stale_requests = 0
        """GenerateReqs addressed to an earlier scheduler boot (GenerateReq.scheduler_boot_id):
        dropped, the tokenizer resubmits them to this one."""
        self.worker = WorkerCounters()
        """Mirror of the worker's cumulative counters, as of the last StepResult."""
        self._last_publish = 0.0
        self._published_busy = False
        self._last_log = time.monotonic()
        self._gen_at_last_log = 0

    @property
    def refused_replies(self) -> int:
        return self.ignored_replies + self.refused_results

    def on_step(self, step: Step, result: StepResult) -> None:
        self.totals.steps += 1
        self.totals.last_step_time_s = time.perf_counter() - step.sent_at
        if self.scheduler.args.profile_steps:
            d = step.descriptor
            logger.info(
                "step %d mode %d rows %d: schedule %.3f ms | sent->result %.3f ms = forward %.3f ms + wire/queue "
                "%.3f ms | worker idle before it %.3f ms | descriptor %d B",
                d.step_id,
                d.forward_mode,
                len(step.expected_seq_lens),
                step.build_s * 1e3,
                self.totals.last_step_time_s * 1e3,
                result.forward_time_s * 1e3,
                (self.totals.last_step_time_s - result.forward_time_s) * 1e3,
                (result.counters.idle_s - self.worker.idle_s) * 1e3,
                self.scheduler.io.last_descriptor_bytes,
            )
        self.worker = result.counters

    def on_drafts(self, tokens_per_row) -> None:
        verified = tokens_per_row[tokens_per_row > 1]
        self.totals.spec_verify_rows += int(len(tokens_per_row))
        self.totals.spec_accepted_drafts += int((verified - 1).sum())

    def snapshot(self) -> SchedulerStats:
        s, w = self.scheduler, self.worker
        return msgspec.structs.replace(
            self.totals,
            running_requests=len(s.batch.reqs),
            queued_requests=len(s.waiting),
            kv_used_tokens=s.kv.used_tokens(),
            kv_total_tokens=s.kv.total_tokens,
            cache_hit_tokens=sum(r.cached_tokens for r in s.batch.reqs),
            prefill_tokens_computed=w.prefill_tokens_computed,
            seq_lens_d2h_copies=w.seq_lens_d2h_copies,
            dropped_frames=s.io.dropped_frames + w.dropped_frames + self.refused_replies + self.stale_requests,
            worker_busy_s=w.busy_s,
            worker_idle_s=w.idle_s,
            worker_cpu_s=w.cpu_s,
            descriptor_bytes=s.io.last_descriptor_bytes,
            rejected_frames=s.io.rejected_frames,
            dp_rank=s.ctx.dp_rank,
        )

    def maybe_publish(self) -> None:
        """Every PUBLISH_INTERVAL_S, and at once when the server goes idle (final numbers)."""
        now = time.monotonic()
        went_idle = self._published_busy and not self.scheduler.has_work()
        if went_idle or now - self._last_publish >= PUBLISH_INTERVAL_S:
            self._last_publish = now
            self._published_busy = self.scheduler.has_work()
            self.scheduler.io.tokenizer.send(self.snapshot())
        if (
            now - self._last_log >= LOG_INTERVAL_S
            and self.scheduler.batch.reqs
            and not self.scheduler.args.disable_log_stats
        ):
            rate = (self.totals.generation_tokens - self._gen_at_last_log) / (now - self._last_log)
            st = self.snapshot()
            logger.info(
                "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.1f, "
                "#queue-req: %d",
                st.running_requests,
                st.kv_used_tokens,
                st.kv_used_tokens / max(1, st.kv_total_tokens),
                rate,
                st.queued_requests,
            )
            self._last_log, self._gen_at_last_log = now, self.totals.generation_tokens

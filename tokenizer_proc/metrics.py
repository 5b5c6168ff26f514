"""Prometheus metrics of the tokenizer process, in a registry of their own.

Two sources:
- measured here, by `RequestHandle`: latencies (time to first token, inter-token latency,
  end-to-end), token counters, and the prefix cache hit rate (cumulative, from each
  request's first output: its prompt length and how much of it came from the cache);
- mirrored from the schedulers' latest `SchedulerStats` at scrape time by `_SchedulerCollector`:
  every statistic it defines (`SCHEDULER_STATS`: name, kind and help text), merged over
  data-parallel replicas, dropped frames adding this process's own; and per replica (label
  dp_rank) by `_ReplicaCollector`: requests routed there, open, running, tokens.

The families a vLLM or SGLang dashboard or autoscaler reads are also exported under their
names (`vllm:num_requests_waiting`, `sglang:num_queue_reqs`, ... with a `model_name` label) by
`_PeerNamesCollector`: renamed copies of the same samples at scrape time, nothing counted twice.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from tokenizer_proc.replicas import ReplicaSet
from trident.wire.frontend import SCHEDULER_STATS, SchedulerStats

PREFIX = "trident_"
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class _SchedulerCollector(Collector):
    """Reads the mirrored stats when Prometheus scrapes; never caches them."""

    def __init__(
        self, stats: Callable[[], SchedulerStats | None], own_dropped: Callable[[], int], hit_rate: Callable[[], float]
    ) -> None:
        self._stats = stats
        self._own_dropped = own_dropped
        self._hit_rate = hit_rate

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        # Exported before any scheduler reports: this process drops frames of its own.
        yield _stat_family("dropped_frames", self._own_dropped() + (s.dropped_frames if s else 0))
        # Not SchedulerStats.cache_hit_tokens: that covers only the requests running now.
        yield GaugeMetricFamily(
            PREFIX + "prefix_cache_hit_rate",
            "Fraction of prompt tokens served from the prefix cache.",
            value=self._hit_rate(),
        )
        if s is None:
            return
        usage = s.kv_used_tokens / s.kv_total_tokens if s.kv_total_tokens else 0.0
        yield GaugeMetricFamily(PREFIX + "kv_cache_usage_ratio", "Fraction of KV token slots in use.", value=usage)
        for name in SCHEDULER_STATS:
            if name != "dropped_frames":
                yield _stat_family(name, getattr(s, name))


def _stat_family(name: str, value: float) -> Metric:
    """The family of `SchedulerStats.<name>`, as its `Stat` defines it (kind, name, help)."""
    stat = SCHEDULER_STATS[name]
    family = CounterMetricFamily if stat.kind == "counter" else GaugeMetricFamily
    return family(PREFIX + (stat.metric or name), stat.help, value=value)


class TallyHistogram(Collector):
    """A histogram for the per-token path: `observe` only counts, and the samples that a
    prometheus_client `Histogram` of the same name and buckets exports are built at scrape
    time. The inter-token latency is observed once per streamed request per step, and
    `Histogram.observe` takes two locks and walks the buckets in Python, which made it the
    costliest part of a token's metrics. Only the event loop's thread observes, so the
    counts need no lock."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = (*buckets, math.inf)
        self._counts = [0] * len(self._bounds)
        """Per bucket, not cumulative: observations at most its bound and above the one before."""
        self._sum = 0.0
        self._created = time.time()
        registry.register(self)

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value

    def collect(self) -> Iterator[Metric]:
        cumulative = itertools.accumulate(self._counts)
        buckets = [(floatToGoString(b), n) for b, n in zip(self._bounds, cumulative, strict=True)]
        family = HistogramMetricFamily(self._name, self._documentation, buckets=buckets, sum_value=self._sum)
        family.samples.append(Sample(self._name + "_created", {}, self._created))
        yield family


class _ReplicaCollector(Collector):
    """Per data-parallel replica: what the router sent it and what its scheduler reports."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        r = self._replicas
        families = [
            (
                CounterMetricFamily,
                "replica_requests_routed",
                "Requests the tokenizer routed to the replica.",
                lambda d: r.router.routed[d],
            ),
            (
                GaugeMetricFamily,
                "replica_requests_open",
                "Requests routed to the replica and not finished.",
                lambda d: r.router.open_requests[d],
            ),
            (
                GaugeMetricFamily,
                "replica_num_requests_running",
                "Requests in the replica's running batch.",
                lambda d: r.stats[d].running_requests if r.stats[d] else 0,
            ),
            (
                CounterMetricFamily,
                "replica_generation_tokens",
                "Tokens the replica generated.",
                lambda d: r.stats[d].generation_tokens if r.stats[d] else 0,
            ),
            (
                CounterMetricFamily,
                "replica_rejected_frames",
                "Frames with a bad HMAC tag at the replica.",
                lambda d: r.stats[d].rejected_frames if r.stats[d] else 0,
            ),
        ]
        for kind, name, doc, value in families:
            family = kind(PREFIX + name, doc, labels=["dp_rank"])
            for d in range(r.size):
                family.add_metric([str(d)], value(d))
            yield family


PEER_NAMES = {
    PREFIX + "num_requests_running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    PREFIX + "num_requests_waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    PREFIX + "kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc", "sglang:token_usage"),
    PREFIX + "prefix_cache_hit_rate": ("sglang:cache_hit_rate",),
    PREFIX + "retractions": ("vllm:num_preemptions",),
    PREFIX + "prompt_tokens": ("vllm:prompt_tokens", "sglang:prompt_tokens"),
    PREFIX + "generation_tokens": ("vllm:generation_tokens", "sglang:generation_tokens"),
    PREFIX + "requests_finished": ("vllm:request_success",),
    PREFIX + "time_to_first_token_seconds": ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds"),
    PREFIX + "inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "sglang:inter_token_latency_seconds"),
    PREFIX + "e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds"),
}
"""Our family -> vLLM's and SGLang's names for the same measure (vLLM's `kv_cache_usage_perc`
and SGLang's `token_usage` are fractions, as ours is; vLLM's `request_success` counts finished
requests by `finished_reason`)."""


class _PeerNamesCollector(Collector):
    """The families of PEER_NAMES again, under each peer's name and labelled with the model
    (`finish_reason` becomes vLLM's `finished_reason`)."""

    def __init__(self, sources: Sequence[Collector], model_name: str) -> None:
        self._sources = sources
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for family in itertools.chain.from_iterable(source.collect() for source in self._sources):
            for name in PEER_NAMES.get(family.name, ()):
                yield self._renamed(family, name)

    def _renamed(self, family: Metric, name: str) -> Metric:
        renamed = Metric(name, family.documentation, family.type)
        for sample in family.samples:
            labels = {"model_name": self._model_name}
            for key, value in sample.labels.items():
                labels["finished_reason" if key == "finish_reason" else key] = value
            renamed.add_sample(name + sample.name[len(family.name) :], labels, sample.value, sample.timestamp)
        return renamed


class Metrics:
    """All metrics of this process. `render()` is the body of GET /metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens submitted.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=r)
        self._uncounted_generation_tokens = 0
        """Tokens generated since the last scrape, added to the counter then (one locked
        `inc` a scrape rather than one a request a step)."""
        self.finished = Counter(PREFIX + "requests_finished", "Finished requests.", ["finish_reason"], registry=r)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Submit to first token.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = TallyHistogram(
            PREFIX + "inter_token_latency_seconds", "Between token outputs.", LATENCY_BUCKETS, registry=r
        )
        self.restarts = Counter(PREFIX + "restarts", "Process restarts by launch.py (any role).", registry=r)
        self.resumed_requests = Counter(
            PREFIX + "resumed_requests", "Requests resubmitted after a scheduler restart.", registry=r
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Submit to finish.", buckets=E2E_BUCKETS, registry=r
        )
        self.cache_hit_tokens = Counter(
            PREFIX + "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", registry=r
        )
        self._prefilled_prompt_tokens = 0
        self._cached_prompt_tokens = 0

    def count_generated(self, tokens: int) -> None:
        self._uncounted_generation_tokens += tokens

    def observe_prefill(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A request's first output: its prompt ran, `cached_tokens` of it from the prefix cache."""
        self._prefilled_prompt_tokens += prompt_tokens
        self._cached_prompt_tokens += cached_tokens
        self.cache_hit_tokens.inc(cached_tokens)

    def cache_hit_rate(self) -> float:
        return self._cached_prompt_tokens / self._prefilled_prompt_tokens if self._prefilled_prompt_tokens else 0.0

    def attach_scheduler(
        self,
        stats: Callable[[], SchedulerStats | None],
        own_dropped: Callable[[], int],
        replicas: ReplicaSet,
        model_name: str,
    ) -> None:
        scheduler = _SchedulerCollector(stats, own_dropped, self.cache_hit_rate)
        self.registry.register(scheduler)
        self.registry.register(_ReplicaCollector(replicas))
        own = [self.prompt_tokens, self.generation_tokens, self.finished, self.ttft, self.itl, self.e2e]
        self.registry.register(_PeerNamesCollector([*own, scheduler], model_name))

    def render(self) -> bytes:
        self.generation_tokens.inc(self._uncounted_generation_tokens)
        self._uncounted_generation_tokens = 0
        return generate_latest(self.registry)

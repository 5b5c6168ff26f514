"""Abort frees a request's slot within about a step; /metrics, /health_generate, /server_info.

The server runs the tiny random model (fast steps, a long context), so a request with
ignore_eos and a huge max_tokens would run for minutes unless the abort works. The
running-request count comes from `GET /server_info`'s `scheduler_stats`, which the
scheduler publishes every 0.5 s.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import Server, make_random_llama, wait_until
from tokenizer_proc.metrics import PEER_NAMES
from trident.wire.frontend import SCHEDULER_STATS, SchedulerStats

LONG = 30000
"""max_tokens of the requests that get aborted: minutes of decoding on this model."""
FREED_WITHIN_S = 5.0
"""A step takes milliseconds here and stats come every 0.5 s; the rest is room for a loaded machine.
Without the abort the request would decode for minutes."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_random_llama(str(tmp_path_factory.mktemp("tiny-llama")), max_position=LONG + 2048)
    s = Server(["--model", model, "--max-total-tokens", str(LONG + 4096)])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model_name(server) -> str:
    return server.http().get("/v1/models").json()["data"][0]["id"]


def running(server: Server) -> int:
    s = server.scheduler_stats()
    return s.get("running_requests", 0) + s.get("queued_requests", 0)


def long_request(model_name: str, **kw) -> dict:
    return {
        "model": model_name,
        "prompt": "Tell me everything.",
        "max_tokens": LONG,
        "ignore_eos": True,
        "temperature": 0,
        **kw,
    }


def assert_freed_soon(server: Server, since: float) -> None:
    assert wait_until(lambda: running(server) == 0, FREED_WITHIN_S, interval=0.05), server.scheduler_stats()
    took = time.monotonic() - since
    generated = server.scheduler_stats()["generation_tokens"]
    time.sleep(0.6)  # a stats period later the count has not moved: nothing decodes any more
    assert server.scheduler_stats()["generation_tokens"] == generated
    assert took < FREED_WITHIN_S


def test_client_disconnect_mid_stream_frees_the_slot(server, model_name):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=long_request(model_name, stream=True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept referenced: dropping a half-read iterator closes the connection
            for _ in range(5):
                assert next(ln for ln in lines if ln.startswith("data: "))
            assert wait_until(lambda: running(server) == 1, 15, interval=0.05)
            left = time.monotonic()
        # leaving the block closes the connection mid-stream
    assert_freed_soon(server, left)


def test_client_that_gives_up_on_a_non_streaming_request_frees_the_slot(server, model_name):
    with httpx.Client(base_url=server.base_url, timeout=2.0) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=long_request(model_name))
        gave_up = time.monotonic()
    assert_freed_soon(server, gave_up)


def test_post_abort_with_the_openai_id_ends_the_stream_with_abort(server, model_name):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        with c.stream(
            "POST",
            "/v1/chat/completions",
            json={
                **{k: v for k, v in long_request(model_name, stream=True).items() if k != "prompt"},
                "messages": [{"role": "user", "content": "Hi"}],
            },
        ) as r:
            lines = r.iter_lines()
            first = json.loads(next(ln for ln in lines if ln.startswith("data: "))[6:])
            assert wait_until(lambda: running(server) == 1, 15, interval=0.05)
            aborted_at = time.monotonic()
            res = c.post("/abort", json={"rid": first["id"]})
            assert res.status_code == 200 and res.json()["aborted"] == [first["id"] + "-0"]
            rest = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ") and ln != "data: [DONE]"]
    assert rest[-1]["choices"][0]["finish_reason"] == "abort"
    assert_freed_soon(server, aborted_at)


def test_a_request_named_by_the_client_answers_and_aborts_under_that_name(server, model_name):
    """vLLM's `request_id` (or the X-Request-Id header) names the request: the response id
    is `cmpl-<name>`, /abort stops it by that id, and the name cannot be reused while open."""
    name = f"client-{uuid.uuid4().hex}"
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        with c.stream(
            "POST", "/v1/completions", json={**long_request(model_name, stream=True), "request_id": name}
        ) as r:
            lines = r.iter_lines()
            first = json.loads(next(ln for ln in lines if ln.startswith("data: "))[6:])
            assert first["id"] == f"cmpl-{name}"
            # Statistics come every 0.5 s: until one shows it running, "nothing running" is stale.
            assert wait_until(lambda: running(server) == 1, 15, interval=0.05)
            again = c.post("/v1/completions", json={**long_request(model_name), "request_id": name})
            assert again.status_code == 400 and again.json()["error"]["param"] == "request_id", again.text
            aborted_at = time.monotonic()
            assert c.post("/abort", json={"rid": f"cmpl-{name}"}).json()["aborted"] == [f"cmpl-{name}-0"]
            rest = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ") and ln != "data: [DONE]"]
        assert rest[-1]["choices"][0]["finish_reason"] == "abort"
        assert_freed_soon(server, aborted_at)
        chat = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        by_header = c.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": name})
        assert by_header.json()["id"] == f"chatcmpl-{name}"
        too_long = c.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "x" * 257})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "X-Request-Id"


def test_post_abort_with_a_client_rid_ends_a_generate_request(server):
    rid = f"mine-{uuid.uuid4().hex[:8]}"
    result: dict = {}

    def generate() -> None:
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            result.update(
                c.post(
                    "/generate",
                    json={
                        "text": "Tell me everything.",
                        "rid": rid,
                        "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True, "temperature": 0},
                    },
                ).json()
            )

    t = threading.Thread(target=generate)
    t.start()
    assert wait_until(lambda: running(server) == 1, 10, interval=0.05)
    aborted_at = time.monotonic()
    assert server.http().post("/abort", json={"rid": rid}).json()["aborted"] == [rid]
    t.join(10)
    assert result["meta_info"]["finish_reason"] == "abort"
    assert 0 < result["meta_info"]["completion_tokens"] < LONG
    assert_freed_soon(server, aborted_at)
    assert server.http().post("/abort", json={"rid": rid}).json()["aborted"] == []  # gone already


# ---------------------------------------------------------------- observability


def scrape(server: Server) -> dict[str, dict]:
    """{family name: {"type": ..., "help": ..., "samples": {sample name + labels: value}}}."""
    text = server.http().get("/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        samples = {s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else ""): s.value for s in fam.samples}
        out[fam.name] = {"type": fam.type, "help": fam.documentation, "samples": samples}
    return out


def test_metrics_expose_load_kv_cache_throughput_latency_steps_restarts_and_dropped_frames(server, model_name):
    prompt = f"{uuid.uuid4().hex} " + "shared prefix " * 20
    with server.http() as c:
        first = c.post(
            "/v1/completions", json={"model": model_name, "prompt": prompt, "max_tokens": 8, "ignore_eos": True}
        ).json()
        stream = c.post(
            "/v1/completions",
            json={"model": model_name, "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "stream": True},
        )
        assert stream.status_code == 200
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert wait_until(lambda: running(server) == 0, 5)
    time.sleep(0.6)  # the next stats frame
    m = scrape(server)

    gauges = [
        "trident_num_requests_running",
        "trident_num_requests_waiting",
        "trident_kv_cache_usage_ratio",
        "trident_prefix_cache_hit_rate",
        "trident_step_time_seconds",
    ]
    counters = [
        "trident_prompt_tokens",
        "trident_generation_tokens",
        "trident_restarts",
        "trident_dropped_frames",
        "trident_prefix_cache_hit_tokens",
    ]
    histograms = ["trident_time_to_first_token_seconds", "trident_inter_token_latency_seconds"]
    for name, kind in [
        *((g, "gauge") for g in gauges),
        *((c, "counter") for c in counters),
        *((h, "histogram") for h in histograms),
    ]:
        assert name in m, f"/metrics lacks {name}"
        assert m[name]["type"] == kind, name

    def value(name: str) -> float:
        samples = m[name]["samples"]
        return samples.get(name + "_total", samples.get(name + "_count", samples.get(name)))

    assert value("trident_num_requests_running") == 0
    assert value("trident_generation_tokens") >= 16
    assert value("trident_prompt_tokens") >= 2 * first["usage"]["prompt_tokens"]
    assert value("trident_time_to_first_token_seconds") >= 2
    assert value("trident_inter_token_latency_seconds") >= 7  # the streamed request's gaps at least
    assert value("trident_step_time_seconds") > 0
    assert value("trident_restarts") == 0 and value("trident_dropped_frames") == 0
    # The second request found the first one's prompt in the cache; the rate counts finished
    # requests too, not only the running ones.
    assert value("trident_prefix_cache_hit_tokens") >= first["usage"]["prompt_tokens"] - 1
    assert 0 < value("trident_prefix_cache_hit_rate") < 1


def test_every_scheduler_statistic_is_in_metrics_as_its_wire_struct_defines_it(server):
    """SchedulerStats is the one definition of each scheduler counter: /metrics exports every
    field but the dp_rank label, under the name, kind and help text of its Stat."""
    assert set(SCHEDULER_STATS) == set(SchedulerStats.__struct_fields__) - {"dp_rank"}
    assert wait_until(lambda: server.http().get("/server_info").json()["scheduler_stats"] is not None, 5)
    m = scrape(server)
    for name, stat in SCHEDULER_STATS.items():
        family = "trident_" + (stat.metric or name)
        assert family in m, f"/metrics lacks {family} (SchedulerStats.{name})"
        assert (m[family]["type"], m[family]["help"]) == (stat.kind, stat.help), family
    total = server.http().get("/server_info").json()["scheduler_stats"]["kv_total_tokens"]
    assert m["trident_kv_cache_total_tokens"]["samples"]["trident_kv_cache_total_tokens"] == total


def test_the_families_peer_dashboards_read_are_also_exported_under_vllm_and_sglang_names(server, model_name):
    """Each family of PEER_NAMES again under vLLM's and SGLang's names, with a model_name label
    (and vLLM's finished_reason for our finish_reason): the same kind and, idle, the same values."""
    with server.http() as c:
        c.post("/v1/completions", json={"model": model_name, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
    assert wait_until(lambda: running(server) == 0, 5)
    time.sleep(0.6)  # the next stats frame
    m = scrape(server)
    for ours, theirs in ((o, t) for o, names in PEER_NAMES.items() for t in names):
        assert ours in m and theirs in m, (ours, theirs)
        assert m[theirs]["type"] == m[ours]["type"], theirs
        expected = {}
        for key, value in m[ours]["samples"].items():
            sample, _, labels = key.partition("{")
            labels = json.loads("{" + labels) if labels else {}
            labels = {"finished_reason" if k == "finish_reason" else k: v for k, v in labels.items()}
            renamed = theirs + sample[len(ours) :] + json.dumps(labels | {"model_name": model_name}, sort_keys=True)
            expected[renamed] = value
        assert m[theirs]["samples"] == expected, theirs
    finished = m["vllm:request_success"]["samples"]
    assert finished[f'vllm:request_success_total{{"finished_reason": "length", "model_name": "{model_name}"}}'] >= 1


def test_health_generate_runs_a_token_through_every_process(server):
    with server.http() as c:
        before = server.scheduler_stats()["generation_tokens"]
        assert c.get("/health").status_code == 200
        assert c.get("/health_generate").status_code == 200
        assert wait_until(lambda: server.scheduler_stats()["generation_tokens"] > before, 3)


def test_server_info_reports_arguments_limits_and_live_stats(server):
    info = server.http().get("/server_info").json()
    assert info["served_model_name"] and info["max_total_tokens"] == LONG + 4096
    assert "api_key" not in info
    assert info["scheduler_info"]["context_length"] == LONG + 2048
    assert info["scheduler_info"]["vocab_size"] == 49152 and info["scheduler_info"]["eos_token_ids"]
    stats = info["scheduler_stats"]
    for key in (
        "running_requests",
        "queued_requests",
        "kv_used_tokens",
        "kv_total_tokens",
        "generation_tokens",
        "prompt_tokens",
        "steps",
        "last_step_time_s",
        "dropped_frames",
        "retractions",
    ):
        assert key in stats, key
    assert stats["kv_total_tokens"] >= LONG + 4096
    assert info["tokenizer_stats"]["open_requests"] == 0 and info["tokenizer_stats"]["dropped_frames"] == 0


def test_worker_cpu_seconds_grow_with_its_steps_and_stay_within_what_the_process_used(server, model_name):
    """worker_cpu_s counts the worker's CPU (all threads) over its steps only: it grows with
    the steps it ran, and it cannot pass the CPU the worker process has used since it started
    (which also holds its start-up and its waits)."""
    worker = next(p for p in server.process_tree() if " ".join(p.cmdline()).startswith("trident::worker"))
    assert wait_until(lambda: server.scheduler_stats().get("steps") is not None, 5)
    before = server.scheduler_stats()
    with server.http() as c:
        r = c.post(
            "/v1/completions", json={"model": model_name, "prompt": "Count:", "max_tokens": 32, "ignore_eos": True}
        )
        assert r.status_code == 200
    assert wait_until(lambda: server.scheduler_stats()["steps"] >= before["steps"] + 32, 5)
    time.sleep(0.6)  # the next stats frame, with the last step's counters
    after = server.scheduler_stats()
    process_cpu = sum(worker.cpu_times()[:2])
    assert after["worker_cpu_s"] > before["worker_cpu_s"]
    assert after["worker_cpu_s"] <= process_cpu

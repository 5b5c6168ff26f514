"""The real tokenizer and scheduler driving simulated workers (`--worker simulated`), through
the official openai client, with the seq_lens contract checked every step."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import running_server, wait_until, write_sim_profile

PROMPTS = [f"Request {i}: " + "tell me about the sea and the ships " * (1 + i % 5) for i in range(10)]
MAX_TOKENS = [8 + 7 * i for i in range(10)]


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> str:
    """2 ms a step plus 20 us a token: quick, but long enough for steps to overlap."""
    return write_sim_profile(str(tmp_path_factory.mktemp("sim") / "profile.json"), const_s=0.002)


def sim_args(profile: str, *extra: str) -> list[str]:
    return [
        "--worker",
        "simulated",
        "--sim-profile",
        profile,
        "--check-seq-lens",
        "--chunked-prefill-size",
        "16",
        "--max-running-requests",
        "6",
        *extra,
    ]


def completions(server, stream: bool) -> list[str]:
    client = server.client(timeout=60)

    def one(i: int) -> str:
        kw = dict(
            model="smollm2-135m",
            prompt=PROMPTS[i],
            max_tokens=MAX_TOKENS[i],
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        if not stream:
            r = client.completions.create(**kw)
            assert r.usage.completion_tokens == MAX_TOKENS[i]
            return r.choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


def test_output_is_deterministic_across_runs_overlap_and_speculation(profile):
    with running_server(sim_args(profile)) as server:
        first = completions(server, stream=True)
        again = completions(server, stream=False)  # now with prefix-cache hits
        stats = server.http().get("/server_info").json()["scheduler_stats"]
        assert stats["seq_lens_d2h_copies"] > 0 and stats["overlapped_steps"] > 0
        assert "simulated: test profile" in server.log_tail(200)
    assert again == first
    assert len(set(first)) == len(first) and all(len(t) > 10 for t in first)
    with running_server(sim_args(profile, "--disable-overlap", "--speculative-algorithm", "ngram")) as server:
        assert completions(server, stream=False) == first
        http = server.http()
        # Statistics are published every half second: wait for the last of them.
        assert wait_until(lambda: http.get("/server_info").json()["scheduler_stats"]["spec_accepted_drafts"] > 0, 5)

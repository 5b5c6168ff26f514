"""The offline Engine runs the same processes as launch.py, without HTTP, and gives the same results."""

from __future__ import annotations

import os

import numpy as np
import psutil
import pytest

from tests.test_prompt_logprobs import ATOL, reference_logprobs, token_logprobs
from trident.engine import Engine

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Q: What is the largest planet in the solar system?\nA:",
]
GREEDY = {"temperature": 0, "max_new_tokens": 24}
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Say hello."}],
]
BEGUN = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "A fruit I like is"}]


def served_greedy(server, prompt: str) -> dict:
    r = server.http().post("/generate", json={"text": prompt, "sampling_params": GREEDY})
    r.raise_for_status()
    return r.json()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_engine_greedy_output_equals_the_http_server_and_leaves_no_process(smollm2_server, hf_reference):
    over_http = [served_greedy(smollm2_server, p) for p in PROMPTS]

    with Engine(dtype="float32", max_total_tokens=16384) as engine:
        pids, run_dir = engine.pids, engine.run_dir
        titles = sorted(" ".join(psutil.Process(pid).cmdline()).strip() for pid in pids)
        assert titles == ["trident::scheduler", "trident::worker[tp0]"]
        offline = engine.generate(PROMPTS, GREEDY)
        # A single prompt, per-prompt parameters and a stop string go through the same path.
        single = engine.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 4})
        stop = over_http[1]["text"][5:9]
        cut = engine.generate(PROMPTS[:2], [GREEDY, {**GREEDY, "stop": stop}])
        scored = engine.generate(
            PROMPTS[2:], {"max_new_tokens": 1}, return_logprob=True, logprob_start_len=0, top_logprobs_num=2
        )
        beams = engine.beam_search(PROMPTS[:2], beam_width=3, max_tokens=6)
        chats = engine.chat(CONVERSATIONS, GREEDY)
        begun = engine.chat(BEGUN, GREEDY, continue_final_message=True)
        with pytest.raises(ValueError, match="chat template"):
            engine.chat([*BEGUN[:1], {"role": "assistant", "content": ""}], GREEDY, continue_final_message=True)
        with pytest.raises(ValueError, match="beam_width"):
            engine.beam_search(PROMPTS[0], beam_width=11, max_tokens=4)
        with pytest.raises(ValueError, match="temprature"):
            engine.generate(PROMPTS[0], {"temprature": 0})
        with pytest.raises(ValueError, match="temperature"):
            engine.generate(PROMPTS[0], {"temperature": 5})

    for prompt, want, got in zip(PROMPTS, over_http, offline):
        assert got["text"] == want["text"], prompt
        assert got["output_ids"] == want["output_ids"], prompt
        assert got["finish_reason"] == want["meta_info"]["finish_reason"]
        assert got["prompt_tokens"] == want["meta_info"]["prompt_tokens"]
        assert got["completion_tokens"] == len(got["output_ids"])
    assert single[0]["output_ids"] == over_http[0]["output_ids"][:4]
    assert single[0]["finish_reason"] == "length"
    assert cut[0]["text"] == over_http[0]["text"]
    assert cut[1]["text"] == over_http[1]["text"][: over_http[1]["text"].find(stop)]
    for prompt, out in zip(PROMPTS[2:], scored):  # prompt logprobs, as transformers' float32
        ids = hf_reference[0](prompt).input_ids
        entries = out["input_token_logprobs"]
        assert [t for _, t, _ in entries] == ids and entries[0][0] is None
        expected = token_logprobs(reference_logprobs(hf_reference, ids), ids)
        np.testing.assert_allclose([lp for lp, _, _ in entries[1:]], expected, atol=ATOL)
        assert out["input_top_logprobs"][0] is None and all(len(top) == 2 for top in out["input_top_logprobs"][1:])
        assert len(out["output_token_logprobs"]) == len(out["output_top_logprobs"]) == 1
    assert cut[1]["finish_reason"] == "stop"
    for prompt, got in zip(PROMPTS[:2], beams):  # the beams /v1/completions' use_beam_search finds
        served = smollm2_server.client().completions.create(
            model="smollm2-135m",
            prompt=prompt,
            n=3,
            max_tokens=6,
            logprobs=0,
            extra_body={"use_beam_search": True, "return_token_ids": True},
        )
        assert [b["output_ids"] for b in got] == [c.model_extra["token_ids"] for c in served.choices]
        assert [b["text"] for b in got] == [c.text for c in served.choices]
        cum = [sum(c.logprobs.token_logprobs) for c in served.choices]
        assert [b["cum_logprob"] for b in got] == pytest.approx(cum, abs=1e-3)

    client = smollm2_server.client()
    for conversation, got in zip(CONVERSATIONS, chats):  # what the chat route answers
        served = client.chat.completions.create(
            model="smollm2-135m", messages=conversation, temperature=0, max_tokens=24
        ).choices[0]
        assert got["text"] == served.message.content and got["finish_reason"] == served.finish_reason
    served = client.chat.completions.create(
        model="smollm2-135m", messages=BEGUN, temperature=0, max_tokens=24, extra_body={"continue_final_message": True}
    )
    assert begun[0]["text"] == served.choices[0].message.content

    assert not [pid for pid in pids if alive(pid)]
    assert not os.path.exists(run_dir)
    # The Engine's processes are children of this one (the HTTP server's are launch.py's).
    assert not [p for p in psutil.Process().children() if alive(p.pid) and p.name().startswith("trident::")]


def test_engine_rejects_unknown_flags_and_missing_models_before_starting_anything(tmp_path):
    with pytest.raises(TypeError, match="no_such_flag"):
        Engine(no_such_flag=1)
    with pytest.raises(ValueError):
        Engine(model=str(tmp_path / "missing.gguf"))

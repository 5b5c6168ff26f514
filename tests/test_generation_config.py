"""A request's sampling defaults come from the model, as vLLM's `--generation-config auto`:
generation_config.json's (or a GGUF's general.sampling.*) temperature, top_p, top_k, min_p,
repetition_penalty and max_new_tokens fill the fields a request leaves out, on every route;
a field the request sends wins. `--generation-config vllm` restores the engine's neutral
defaults and `--override-generation-config` lays the user's values over either.

The served model is a random-weight LLaMA whose generation_config.json recommends top_p 0.9,
top_k 1 and 5 new tokens: a request sampled at temperature 1 is then greedy, which a near-uniform
random model would never be by chance.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import httpx
import pytest

from tests.helpers import REPO_ROOT, make_random_llama, running_server
from trident.generation_config import GenerationConfigError, resolve_sampling_defaults

RECOMMENDED = {"do_sample": True, "top_p": 0.9, "top_k": 1, "max_new_tokens": 5, "eos_token_id": 2, "bos_token_id": 1}
PROMPT = "The history of the lighthouse"
SEEDS = (1, 2, 3, 4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = make_random_llama(str(tmp_path_factory.mktemp("genconfig_llama")), hidden=64, layers=2, seed=3, scale=0.02)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(RECOMMENDED, f)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(["--model", model_dir, "--dtype", "float32", "--served-model-name", "m"]) as s:
        yield s


def write_gguf_metadata(path: str, **sampling: float | int) -> str:
    """A GGUF holding only metadata: what the sampling defaults are read from."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    for key, value in sampling.items():
        if isinstance(value, int):
            writer.add_int32(f"general.sampling.{key}", value)
        else:
            writer.add_float32(f"general.sampling.{key}", value)
    writer.add_string("general.sampling.sequence", "edkypmxt")  # llama.cpp's sampler order: no counterpart
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_auto_takes_the_sampling_fields_of_generation_config_json(model_dir):
    assert resolve_sampling_defaults("auto", None, model_dir) == {"top_p": 0.9, "top_k": 1, "max_new_tokens": 5}
    assert resolve_sampling_defaults("vllm", None, model_dir) == {}


def test_auto_takes_a_ggufs_general_sampling_metadata_as_written(tmp_path):
    path = write_gguf_metadata(str(tmp_path / "m.gguf"), temp=0.7, top_k=40, top_p=0.9, min_p=0.05, penalty_repeat=1.1)
    defaults = resolve_sampling_defaults("auto", None, path)
    assert defaults == {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1}
    assert isinstance(defaults["top_k"], int)


def test_a_directory_and_the_override_are_laid_over_in_order(tmp_path, model_dir):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_p": 0.5}))
    assert resolve_sampling_defaults(str(tmp_path), {"top_p": 0.8, "max_new_tokens": 9}, model_dir) == {
        "temperature": 0.3,
        "top_p": 0.8,
        "max_new_tokens": 9,
    }
    assert resolve_sampling_defaults("vllm", {"temperature": 0}, model_dir) == {"temperature": 0.0}


@pytest.mark.parametrize(
    "choice, override, named",
    [
        ("vllm", {"temperature": 3}, "temperature 3 is outside [0.0, 2.0]"),
        ("vllm", {"top_p": 0}, "top_p 0 is outside (0.0, 1.0]"),
        ("vllm", {"top_k": 2.5}, "top_k 2.5 is not a whole number"),
        ("vllm", {"max_new_tokens": 0}, "max_new_tokens 0 is below 1"),
        ("vllm", {"temperature": "hot"}, "temperature 'hot' is not a number"),
        ("vllm", {"temp": 1}, "temp cannot be defaulted"),
        ("/no/such/dir", None, "/no/such/dir/generation_config.json: no such file"),
    ],
)
def test_a_bad_user_value_is_an_error_naming_it(choice, override, named, model_dir):
    with pytest.raises(GenerationConfigError, match=named.replace("(", r"\(").replace("[", r"\[")):
        resolve_sampling_defaults(choice, override, model_dir)


def test_a_models_own_value_outside_the_range_is_left_out_with_a_warning(tmp_path, caplog):
    path = write_gguf_metadata(str(tmp_path / "m.gguf"), temp=0.8, top_p=0.0)
    with caplog.at_level(logging.WARNING, logger="trident.generation_config"):
        assert resolve_sampling_defaults("auto", None, path) == {"temperature": 0.8}
    assert "top_p 0.0, which is outside (0.0, 1.0]" in caplog.text


def test_the_launcher_refuses_a_bad_override_before_starting_anything(model_dir):
    command = [sys.executable, os.path.join(REPO_ROOT, "launch.py"), "--model", model_dir]
    command += ["--override-generation-config", '{"top_k": -5}']
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "top_k -5 is outside [-1" in done.stderr, done.stderr
    assert "ready" not in done.stdout


def completion_texts(server, **body) -> list[str]:
    client = server.client()
    return [
        client.completions.create(model="m", prompt=PROMPT, max_tokens=8, seed=seed, **body).choices[0].text
        for seed in SEEDS
    ]


def test_the_models_top_k_makes_a_request_at_temperature_1_greedy(server):
    greedy = completion_texts(server, temperature=0)[0]
    assert completion_texts(server, temperature=1.0) == [greedy] * len(SEEDS)
    chat = server.client().chat.completions
    messages = [{"role": "user", "content": PROMPT}]
    greedy_chat = chat.create(model="m", messages=messages, temperature=0, max_tokens=8).choices[0].message.content
    for seed in SEEDS:
        sampled = chat.create(model="m", messages=messages, temperature=1.0, max_tokens=8, seed=seed)
        assert sampled.choices[0].message.content == greedy_chat


def test_a_top_k_the_request_sends_wins_over_the_models(server):
    greedy = completion_texts(server, temperature=0)[0]
    sampled = completion_texts(server, temperature=1.0, extra_body={"top_k": -1})
    assert len(set(sampled)) > 1 and any(text != greedy for text in sampled), sampled


def test_the_models_max_new_tokens_is_every_routes_default_budget(server):
    client = server.client()
    completion = client.completions.create(model="m", prompt=PROMPT, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 5 and completion.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": PROMPT}], extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
    response = client.responses.create(model="m", input=PROMPT)
    assert response.usage.output_tokens <= 5
    native = httpx.post(f"{server.base_url}/generate", json={"text": PROMPT, "sampling_params": {"ignore_eos": True}})
    assert native.status_code == 200 and len(native.json()["output_ids"]) == 5
    asked = client.completions.create(model="m", prompt=PROMPT, max_tokens=7, extra_body={"ignore_eos": True})
    assert asked.usage.completion_tokens == 7


def test_the_defaults_are_announced_and_shown_in_server_info(server):
    assert any(
        "requests that leave them out get top_p 0.9, top_k 1, max_new_tokens 5" in line for line in server.output
    )
    info = httpx.get(f"{server.base_url}/server_info").json()
    assert info["sampling_defaults"] == {"top_p": 0.9, "top_k": 1, "max_new_tokens": 5}
    client = server.client()
    applied = client.responses.create(model="m", input=PROMPT, max_output_tokens=2)
    assert applied.temperature == 1.0 and applied.top_p == 0.9, "the response shows the sampling it got"
    asked = client.responses.create(model="m", input=PROMPT, max_output_tokens=2, top_p=0.5)
    assert asked.top_p == 0.5


def test_the_offline_engine_takes_vllm_and_an_override(model_dir):
    from trident.engine import Engine

    with Engine(
        model=model_dir, dtype="float32", generation_config="vllm", override_generation_config={"max_new_tokens": 3}
    ) as engine:
        assert engine.default_sampling_params() == {"max_new_tokens": 3}
        out = engine.generate([PROMPT], {"ignore_eos": True, "temperature": 0})
        assert len(out[0]["output_ids"]) == 3
        sampled = {engine.generate([PROMPT], {"temperature": 1.0, "seed": s})[0]["text"] for s in SEEDS}
        assert len(sampled) > 1, "the engine's neutral defaults leave temperature 1 sampling"


def test_a_knob_sent_as_null_is_left_out_and_takes_the_models_default(server):
    """OpenAI's schema and vLLM's let a client send null for temperature, top_p and the rest;
    null means the default, here the model's top_k 1."""
    greedy = completion_texts(server, temperature=0)[0]
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": None, "top_p": None, "top_k": None}
    for seed in SEEDS:
        r = httpx.post(f"{server.base_url}/v1/completions", json={**body, "seed": seed}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == greedy
    r = httpx.post(f"{server.base_url}/generate", json={"text": PROMPT, "sampling_params": {"temperature": None}})
    assert r.status_code == 200, r.text

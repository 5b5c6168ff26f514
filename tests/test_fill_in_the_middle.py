"""Completions' `suffix` (OpenAI's fill-in-the-middle): the prompt becomes the text before
and the suffix the text after, joined by the model's own fill-in-the-middle tokens; a model
without them, token-id prompts and echo are 400s naming `suffix`."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.helpers import Server, make_random_llama
from tokenizer_proc.tokenization import FIM_TOKENS, fim_tokens_of

STARCODER_FIM = FIM_TOKENS[0]


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory) -> str:
    return make_random_llama(str(tmp_path_factory.mktemp("fim-llama")), added_special_tokens=STARCODER_FIM)


@pytest.fixture(scope="module")
def fim_server(fim_model):
    server = Server(["--model", fim_model, "--max-total-tokens", "4096"])
    yield server
    server.stop()


def test_a_suffix_makes_the_prompt_prefix_suffix_middle_in_the_models_own_tokens(fim_model, fim_server):
    tokenizer = AutoTokenizer.from_pretrained(fim_model)
    assert fim_tokens_of(tokenizer) == STARCODER_FIM
    prefix, suffix = "def add(a, b):\n    ", "\n    return c\n"
    body = {"prompt": prefix, "suffix": suffix, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    answer = fim_server.http().post("/v1/completions", json=body).json()
    expected = tokenizer.encode(f"<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>")
    marker_ids = tokenizer.convert_tokens_to_ids(list(STARCODER_FIM))
    assert answer["choices"][0]["prompt_token_ids"] == expected
    assert all(expected.count(i) == 1 for i in marker_ids)  # each marker is one token, not its spelling
    assert answer["usage"]["prompt_tokens"] == len(expected) and answer["usage"]["completion_tokens"] == 4
    # A batch of prompts shares the suffix; streamed, the same text comes.
    batch = fim_server.http().post("/v1/completions", json={**body, "prompt": [prefix, "x = "]}).json()
    assert batch["choices"][0]["text"] == answer["choices"][0]["text"] and len(batch["choices"]) == 2
    with fim_server.http().stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
        assert sum(1 for line in stream.iter_lines() if line.startswith("data: {")) >= 1


def test_what_cannot_fill_in_the_middle_is_a_400_naming_suffix(fim_server, smollm2_server):
    refusals = [
        (smollm2_server, {"prompt": "def f():", "suffix": "return 1"}, "fill-in-the-middle tokens"),
        (fim_server, {"prompt": [1, 2, 3], "suffix": "return 1"}, "token ids"),
        (fim_server, {"prompt": "def f():", "suffix": "return 1", "echo": True}, "echo"),
    ]
    for server, body, reason in refusals:
        answer = server.http().post("/v1/completions", json={**body, "max_tokens": 2})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "suffix", answer.text
        assert reason in answer.json()["error"]["message"]

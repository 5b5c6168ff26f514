"""Greedy output served over HTTP equals Hugging Face transformers on the same weights."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tests.helpers import greedy_generations

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
    """transformers' greedy tokens of each prompt, up to and including EOS (the server stops
    at EOS and reports it)."""
    tok, model = hf_reference
    rows = [tok(prompt).input_ids for prompt in prompts]
    wants = []
    for gen in greedy_generations(model, rows, MAX_TOKENS, tok.eos_token_id):
        wants.append(gen[: gen.index(tok.eos_token_id) + 1] if tok.eos_token_id in gen else gen)
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

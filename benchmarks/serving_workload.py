"""The workloads of bench_serving and the comparisons built on it: random, shared-prefix and
the mixed workload of issue 8, all from one seeded RNG so every server sees the same prompts."""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from launched_server import REPO_ROOT

MIXED_NUM_PROMPTS = 48

MIXED_INPUT_RANGE = (32, 256)

MIXED_OUTPUT_RANGE = (16, 192)

# Used only without a tokenizer (`--tokenizer none`): common English words, mostly one token each.
FALLBACK_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there one all we their been has when who will more no if out so said what up its about into "
    "than them can only other new some time could these two may then do first any my now such like our over man me "
    "even most made after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year off come since "
    "against go came right used take three house small water place light city river garden table window morning "
    "music paper story market winter summer forest animal bridge letter number school family friend question"
).split()


@dataclass
class BenchRequest:
    """One request of a workload: the prompt text and the exact output length to ask for."""

    prompt: str
    prompt_len: int
    """Prompt tokens by the client's tokenizer (words when there is none)."""
    output_len: int


@dataclass
class WorkloadSpec:
    """Everything that decides a workload's prompts and lengths (the RNG is seeded from `seed`)."""

    dataset: str = "mixed"
    num_prompts: int | None = None
    random_input_len: tuple[int, int] = (128, 128)
    random_output_len: tuple[int, int] = (128, 128)
    gsp_num_groups: int = 4
    gsp_prompts_per_group: int = 8
    gsp_system_prompt_len: int = 512
    gsp_question_len: int = 32
    gsp_output_len: int = 64
    seed: int = 1


def parse_range(text: str) -> tuple[int, int]:
    """'128' -> (128, 128); '32-256' -> (32, 256)."""
    lo, _, hi = text.partition("-")
    a, b = int(lo), int(hi or lo)
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"bad length range {text!r}: want N or MIN-MAX with 1 <= MIN <= MAX")
    return a, b


def load_tokenizer(spec: str | None) -> Any | None:
    """A Hugging Face tokenizer from a .gguf file or a model directory; 'auto' = trident's default model."""
    if spec is None or spec.lower() == "none":
        return None
    from transformers import AutoTokenizer

    path = spec
    if spec == "auto":
        sys.path.insert(0, REPO_ROOT)
        from trident.model_source import default_model_path

        path = default_model_path()
    if path.endswith(".gguf"):
        directory, name = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return AutoTokenizer.from_pretrained(path)


def single_token_words(tokenizer: Any | None) -> list[str]:
    """Lower-case words that are exactly one token when preceded by a space; sorted, so the set is stable.
    A leading space is "Ġ" in byte-level BPE vocabularies (SmolLM2) and "▁" in SentencePiece ones (Gemma)."""
    if tokenizer is None:
        return list(FALLBACK_WORDS)
    candidates = sorted(
        tok[1:]
        for tok in tokenizer.get_vocab()
        if tok[:1] in ("Ġ", "▁") and tok[1:].isascii() and tok[1:].isalpha() and tok[1:].islower() and len(tok) >= 4
    )
    if not candidates:
        return list(FALLBACK_WORDS)
    encoded = tokenizer([" " + w for w in candidates], add_special_tokens=False)["input_ids"]
    words = [w for w, ids in zip(candidates, encoded, strict=True) if len(ids) == 1]
    return words or list(FALLBACK_WORDS)


def random_text(rng: random.Random, words: Sequence[str], n: int) -> str:
    """n words, each with a leading space (so each is one token of the tokenizer they came from)."""
    return "".join(" " + rng.choice(words) for _ in range(n))


def gen_random(
    rng: random.Random, words: Sequence[str], num: int, input_len: tuple[int, int], output_len: tuple[int, int]
) -> list[BenchRequest]:
    out = []
    for _ in range(num):
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        out.append(BenchRequest(random_text(rng, words, n_in), n_in, n_out))
    return out


def gen_shared_prefix(rng: random.Random, words: Sequence[str], spec: WorkloadSpec) -> list[BenchRequest]:
    out = []
    for _ in range(spec.gsp_num_groups):
        system = random_text(rng, words, spec.gsp_system_prompt_len)
        for _ in range(spec.gsp_prompts_per_group):
            question = random_text(rng, words, spec.gsp_question_len)
            out.append(
                BenchRequest(system + question, spec.gsp_system_prompt_len + spec.gsp_question_len, spec.gsp_output_len)
            )
    rng.shuffle(out)
    return out


def build_workload(spec: WorkloadSpec, tokenizer: Any | None) -> list[BenchRequest]:
    """The requests of a workload; identical for identical (spec, tokenizer)."""
    rng = random.Random(spec.seed)
    words = single_token_words(tokenizer)
    if spec.dataset == "mixed":
        reqs = gen_random(rng, words, spec.num_prompts or MIXED_NUM_PROMPTS, MIXED_INPUT_RANGE, MIXED_OUTPUT_RANGE)
    elif spec.dataset == "random":
        reqs = gen_random(rng, words, spec.num_prompts or 64, spec.random_input_len, spec.random_output_len)
    elif spec.dataset == "shared-prefix":
        reqs = gen_shared_prefix(rng, words, spec)
    else:
        raise ValueError(f"unknown dataset {spec.dataset!r}")
    if tokenizer is not None:  # the exact count (equal to the word count for single-token words)
        for r in reqs:
            r.prompt_len = len(tokenizer.encode(r.prompt))
    return reqs


def workload_stats(requests: Sequence[BenchRequest]) -> dict[str, Any]:
    ins, outs = [r.prompt_len for r in requests], [r.output_len for r in requests]
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(ins),
        "output_tokens": sum(outs),
        "prompt_len_min_max": [min(ins), max(ins)],
        "output_len_min_max": [min(outs), max(outs)],
    }

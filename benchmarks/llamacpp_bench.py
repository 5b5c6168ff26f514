"""llama.cpp on a GGUF, in process: N sequences of random prompt tokens, then greedy decode.

Runs with the python of llama.cpp's own venv (llama-cpp-python built from its sdist for this
CPU; docs/benchmarks.md, "Method"), started by compare_llamacpp.py, and prints
one JSON line: output tok/s over prefill and decode (what a served client sees, less HTTP),
decode-only tok/s, and the process's resident memory (VmRSS, VmHWM: the model is mmapped,
so the pages of the file it touched count).

All sequences go through the low-level `llama_batch` API in one context: the prompts in
one batch, then one token per sequence per step (the sequences of a step in one batch).
Imports only llama_cpp and numpy, so it runs outside the project's environment.
"""

from __future__ import annotations

import argparse
import json
import time

import llama_cpp as llama
import numpy as np


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Runner:
    def __init__(self, path: str, seqs: int, max_len: int, threads: int) -> None:
        llama.llama_backend_init()
        self.model = llama.llama_model_load_from_file(path.encode(), llama.llama_model_default_params())
        self.n_vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self.model))
        params = llama.llama_context_default_params()
        params.n_ctx = seqs * max_len + 64
        params.n_batch = params.n_ubatch = max(512, seqs)
        params.n_seq_max = seqs
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True
        self.ctx = llama.llama_init_from_model(self.model, params)
        self.n_batch = params.n_batch
        self.batch = llama.llama_batch_init(self.n_batch, 0, 1)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """(token, position, sequence, wants logits) in batches of n_batch; the greedy next
        token of each entry that wants logits."""
        out = []
        for start in range(0, len(entries), self.n_batch):
            chunk = entries[start : start + self.n_batch]
            b = self.batch
            b.n_tokens = len(chunk)
            for i, (token, pos, seq, logits) in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
                b.seq_id[i][0] = seq
            if llama.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (_, _, _, logits) in enumerate(chunk):
                if logits:
                    row = np.ctypeslib.as_array(llama.llama_get_logits_ith(self.ctx, i), (self.n_vocab,))
                    out.append(int(row.argmax()))
        return out

    def generate(self, prompts: np.ndarray, output_len: int) -> dict:
        llama.llama_memory_clear(llama.llama_get_memory(self.ctx), True)
        seqs, prompt_len = prompts.shape
        t0 = time.perf_counter()
        entries = [(int(t), p, s, p == prompt_len - 1) for s in range(seqs) for p, t in enumerate(prompts[s])]
        tokens = self.decode(entries)
        t_prefill = time.perf_counter()
        for step in range(output_len - 1):
            tokens = self.decode([(tokens[s], prompt_len + step, s, True) for s in range(seqs)])
        t_end = time.perf_counter()
        return {
            "output_tok_s": seqs * output_len / (t_end - t0),
            "decode_tok_s": seqs * (output_len - 1) / (t_end - t_prefill),
            "seconds": t_end - t0,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--seqs", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    runner = Runner(args.model, args.seqs, args.prompt_len + args.output_len, args.threads)
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(100, min(20000, runner.n_vocab), (args.seqs, args.prompt_len))
    runner.generate(prompts[:, :8], 4)  # warm-up: pages the model in
    runs = [runner.generate(prompts, args.output_len) for _ in range(args.rounds)]
    print(json.dumps({"runs": runs, "rss_kb": status_kb("VmRSS"), "hwm_kb": status_kb("VmHWM")}))


if __name__ == "__main__":
    main()

"""Batch invariance at the model: the real SmolLM2 through an in-process worker with its
default settings (bf16, our linear kernels, the decode kernel for every query, the flat
decode loop) gives a row the same logits, bit for bit, whatever else its step holds and
whichever path its tokens take.

Both with the weights as shipped (the default for a GGUF: gguf) and dequantized to bf16.

- Across chunkings: a prompt's logits at every position are the same prefilled in one
  chunk, in chunks of 16 or 5, or decoded one token a step (the flat decode loop).
- In prefill: the same among 0 to 70 other prompts of other lengths.
- In decode: a row's logits are the same in plain decode steps of 1, 2, 13 and 80 rows, and
  as the decode row of a step that also prefills a prompt.

The same checks pass on a random-weight checkpoint of every family we serve. The checks are
functions that list the differences they find; the last tests run them on
a model with one deliberately batch-dependent reduction, and on a worker with
`disable_batch_invariance` (oneDNN's linears, SDPA on prompt chunks), and require them to
find some: the checks can fail.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest
import torch

from gpu_worker.kernels.cpu_kernels import load_quant_linear
from gpu_worker.layers.fused_moe import fused_moe_available
from gpu_worker.model.attention import AttentionMetadata, DecodeGroup, ExtendRow, QueryKeys, shifted_causal_mask
from tests.family_models import FAMILY_CHECKPOINTS, MOE_CHECKPOINTS, WINDOW, make_family_checkpoint, write_moe_gguf
from tests.helpers import TEST_CPU_THREADS, smollm2_gguf
from trident.wire.child import ChildContext
from trident.wire.server_args import ServerArgs

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("worker_threads")]  # and on a worker's threads

SEQUENCE_SLOTS = 160
"""Pool tokens each sequence of the checks may fill."""


class Sequences:
    """Sequences laid out in a worker's KV pool (SEQUENCE_SLOTS tokens each), and steps of the
    worker's model over them that return every token's logits. A step carries what the
    worker's BatchState gives its model: a plain decode group (the flat decode loop) when
    every row has one token, else QueryKeys (without batch invariance: causal masks)."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.capacity = (worker.kv_pool.kv[0].shape[0] - 1) // SEQUENCE_SLOTS
        self.count = 0
        self.base: dict[object, int] = {}
        self.length: dict[object, int] = {}

    def new(self, name: object) -> None:
        """A fresh sequence (the pool is reused round robin: only recent sequences are live)."""
        self.base[name] = 1 + (self.count % self.capacity) * SEQUENCE_SLOTS
        self.length[name] = 0
        self.count += 1

    def step(self, rows: list[tuple[object, list[int]]]) -> list[torch.Tensor]:
        """Runs `(sequence, its next tokens)` rows as one step: each row's logits [tokens, vocab]."""
        ids, positions, loc, kv_rows, table, starts = [], [], [], [], [], []
        for i, (name, tokens) in enumerate(rows):
            first, base = self.length[name], self.base[name]
            assert first + len(tokens) <= SEQUENCE_SLOTS
            starts.append(len(ids))
            ids += tokens
            positions += range(first, first + len(tokens))
            loc += range(base + first, base + first + len(tokens))
            kv_rows += [i] * len(tokens)
            table.append(list(range(base, base + first + len(tokens))))
            self.length[name] = first + len(tokens)
        width = max(len(t) for t in table)
        kv_table = torch.tensor([t + [0] * (width - len(t)) for t in table])
        kv_lens = torch.tensor([len(t) for t in table])
        if len(ids) == len(rows):  # a plain decode step
            group = DecodeGroup(
                token_idx=torch.arange(len(rows))[:, None],
                q_valid=torch.ones(len(rows), 1, dtype=torch.bool),
                kv_indices=kv_table,
                kv_lens=kv_lens,
                bias=torch.empty(0),
                covers_batch=True,
            )
            meta = AttentionMetadata(torch.tensor(loc), [group], [])
        elif self.worker.batch_invariant:
            extend = [
                ExtendRow(start, len(tokens), self.length[name] - len(tokens), torch.tensor(t), None)
                for (name, tokens), start, t in zip(rows, starts, table)
            ]
            query_keys = QueryKeys(kv_table, torch.tensor(kv_rows), torch.tensor(positions) + 1)
            meta = AttentionMetadata(torch.tensor(loc), [], extend, query_keys)
        else:  # prompt chunks through SDPA, each with its causal mask over its cached prefix
            extend = []
            for (name, tokens), start, t in zip(rows, starts, table):
                prefix = self.length[name] - len(tokens)
                mask = shifted_causal_mask(len(tokens), prefix, torch.device("cpu")) if prefix else None
                extend.append(ExtendRow(start, len(tokens), prefix, torch.tensor(t), mask))
            meta = AttentionMetadata(torch.tensor(loc), [], extend)
        model, pool = self.worker.model, self.worker.kv_pool
        logits = model(torch.tensor(ids), torch.tensor(positions), pool, meta, torch.arange(len(ids)))
        return [logits[s : s + len(tokens)].clone() for s, (_, tokens) in zip(starts, rows)]

    def prefill(self, name: object, tokens: list[int], chunk: int) -> torch.Tensor:
        self.new(name)
        return torch.cat([self.step([(name, tokens[i : i + chunk])])[0] for i in range(0, len(tokens), chunk)])


def random_prompt(gen: torch.Generator, length: int) -> list[int]:
    return torch.randint(100, 40000, (length,), generator=gen).tolist()


def chunking_differences(seqs: Sequences, prompt: list[int]) -> list[str]:
    """Positions where a prompt's logits differ between prefilling it whole, in chunks of 16
    and 5, and decoding it one token a step."""
    whole = seqs.prefill("whole", prompt, len(prompt))
    found = []
    for chunk in (16, 5):
        got = seqs.prefill(("chunks", chunk), prompt, chunk)
        found += [f"chunks of {chunk}: position {p}" for p in differing_positions(got, whole)]
    seqs.new("decoded")
    decoded = [seqs.step([("decoded", prompt[:1])])[0]]
    decoded += [seqs.step([("decoded", [token])])[0] for token in prompt[1:]]
    found += [f"decoded: position {p}" for p in differing_positions(torch.cat(decoded), whole)]
    return found


def crowd_differences(seqs: Sequences, prompt: list[int], gen: torch.Generator) -> list[str]:
    """Crowd sizes at which a prompt's prefill logits differ from its prefill alone."""
    alone = seqs.prefill("alone", prompt, len(prompt))
    found = []
    for size in (1, 7, 70):
        others = [(("other", size, i), random_prompt(gen, int(n))) for i, n in enumerate(torch.randint(1, 60, (size,)))]
        for name, _ in others:
            seqs.new(name)
        seqs.new(("target", size))
        rows = [*others[: size // 2], (("target", size), prompt), *others[size // 2 :]]
        if not torch.equal(seqs.step(rows)[size // 2], alone):
            found.append(f"among {size} prompts")
    return found


def decode_batch_differences(seqs: Sequences, prompt: list[int], gen: torch.Generator) -> list[str]:
    """Batch sizes at which a decode row's logits (the prompt's last token, after the rest was
    prefilled) differ from its plain decode step alone; "mixed" for a step that also prefills."""

    def decode_last_token_among(others: int, with_prefill: bool) -> torch.Tensor:
        names = [("decoding", others, i) for i in range(others)]
        for name in ["target", *names]:
            seqs.new(name)
        seqs.step([("target", prompt[:-1]), *[(name, random_prompt(gen, 3 + i % 40)) for i, name in enumerate(names)]])
        rows = [(name, random_prompt(gen, 1)) for name in names]
        if with_prefill:
            seqs.new("prefilling")
            rows.append(("prefilling", random_prompt(gen, 30)))
        rows.insert(others // 2, ("target", prompt[-1:]))
        return seqs.step(rows)[others // 2]

    alone = decode_last_token_among(0, with_prefill=False)
    found = [f"{n + 1} decode rows" for n in (1, 12, 79) if not torch.equal(decode_last_token_among(n, False), alone)]
    if not torch.equal(decode_last_token_among(5, with_prefill=True), alone):
        found.append("mixed")
    return found


def differing_positions(got: torch.Tensor, want: torch.Tensor) -> list[int]:
    return [p for p in range(len(want)) if not torch.equal(got[p], want[p])]


def default_worker(model_path: str | None = None, **args) -> Iterator:
    from gpu_worker.runtime.worker import Worker

    server_args = ServerArgs(
        model_path=model_path or smollm2_gguf(),
        max_total_tokens=16384,
        max_running_requests=8,
        run_dir=tempfile.mkdtemp(),
        cpu_threads=TEST_CPU_THREADS,
        **args,
    )
    ctx = ChildContext(server_args, "worker", 0)
    try:
        yield Worker(ctx)
    finally:
        ctx.zmq_ctx.destroy(linger=0)


@pytest.fixture(scope="module", params=["gguf", "bf16"])
def worker(request):
    """The default worker on SmolLM2's GGUF (bf16 activations), with its weights as shipped
    (the default, `--weight-dtype auto`) or dequantized to bf16."""
    yield from default_worker(weight_dtype=request.param)


@pytest.fixture
def seqs(worker) -> Sequences:
    return Sequences(worker)


@pytest.fixture
def prompt() -> list[int]:
    return random_prompt(torch.Generator().manual_seed(3), 32)


def test_the_worker_is_batch_invariant_by_default(worker):
    assert worker.batch_invariant and worker.dtype == torch.bfloat16
    assert "batch invariant" in worker.summary()


def test_a_prompts_logits_are_the_same_bits_in_any_chunking_and_decoded_token_by_token(seqs, prompt):
    assert chunking_differences(seqs, prompt) == []


def test_a_prompts_logits_are_the_same_bits_among_1_to_70_other_prompts(seqs, prompt):
    assert crowd_differences(seqs, prompt, torch.Generator().manual_seed(4)) == []


def test_a_decode_rows_logits_are_the_same_bits_in_steps_of_1_to_80_rows_and_beside_a_prefill(seqs, prompt):
    assert decode_batch_differences(seqs, prompt, torch.Generator().manual_seed(5)) == []


@pytest.mark.parametrize("family", FAMILY_CHECKPOINTS + MOE_CHECKPOINTS)
def test_every_family_is_batch_invariant(family, tmp_path):
    """Random-weight checkpoints of each family we serve, with its quirks on (q/k norms,
    biases, rope scalings, Gemma 3's local and global layers, a sliding window shorter than
    the prompt, head dims 16 to 256, routed and shared experts: a token's experts see
    other tokens beside it in each step, on the fused MoE op where it builds)."""
    path = make_family_checkpoint(str(tmp_path / family), family)
    prompt = random_prompt(torch.Generator().manual_seed(6), 3 * WINDOW)
    for worker in default_worker(path):
        assert worker.batch_invariant
        if family in MOE_CHECKPOINTS and fused_moe_available():
            assert worker.experts_kind.startswith("fused-"), worker.experts_kind
        assert chunking_differences(Sequences(worker), prompt) == []
        assert decode_batch_differences(Sequences(worker), prompt, torch.Generator().manual_seed(7)) == []


def test_a_moe_gguf_in_its_own_formats_is_batch_invariant(tmp_path):
    """Qwen3-MoE as a qwen3moe GGUF on the default worker: the experts on the fused op for
    quantized experts (each expert's QuantLinear layers where our quantized kernels do not
    run), the float32 router on our bf16 kernel."""
    checkpoint = make_family_checkpoint(str(tmp_path / "ckpt"), "qwen3_moe_gguf")
    path = write_moe_gguf(checkpoint, str(tmp_path / "qwen3moe.gguf"), "qwen3moe")
    prompt = random_prompt(torch.Generator().manual_seed(6), 3 * WINDOW)
    for worker in default_worker(path):
        assert worker.batch_invariant and worker.weight_dtype == "gguf"
        quant_path = load_quant_linear()
        assert worker.experts_kind == (f"fused-gguf-{quant_path.replace('_', '-')}" if quant_path else "torch")
        assert chunking_differences(Sequences(worker), prompt) == []
        assert decode_batch_differences(Sequences(worker), prompt, torch.Generator().manual_seed(7)) == []


class BatchDependentLinear(torch.nn.Module):
    """A linear layer whose reduction order depends on the batch, as a split-k matmul picks its
    split by the number of rows: it sums k in two parts, split where the row count says."""

    def __init__(self, inner: torch.nn.Module, in_features: int) -> None:
        super().__init__()
        self.inner, self.in_features = inner, in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        split = (x.shape[0] % 7 + 1) * self.in_features // 8
        low, high = x.clone(), x.clone()
        low[:, split:] = 0
        high[:, :split] = 0
        return (self.inner(low).float() + self.inner(high).float()).to(x.dtype)


def test_the_checks_find_a_deliberately_batch_dependent_reduction(prompt):
    for worker in default_worker():
        assert worker.weight_dtype == "gguf", "a GGUF's own formats by default"
        layer = worker.model.layers[0].self_attn
        layer.o_proj = BatchDependentLinear(layer.o_proj, layer.o_proj.in_features)
        worker.model.use_flat_decode(worker.model.flat_decode_enabled)  # the flat loop reads the modules
        assert chunking_differences(Sequences(worker), prompt) != []
        assert crowd_differences(Sequences(worker), prompt, torch.Generator().manual_seed(4)) != []
        assert decode_batch_differences(Sequences(worker), prompt, torch.Generator().manual_seed(5)) != []


def test_the_checks_find_the_previous_kernels_batch_dependent(prompt):
    """oneDNN's linears and SDPA on prompt chunks, as before batch invariance."""
    for worker in default_worker(weight_dtype="bf16", disable_batch_invariance=True):
        assert not worker.batch_invariant
        assert chunking_differences(Sequences(worker), prompt) != []
        assert decode_batch_differences(Sequences(worker), prompt, torch.Generator().manual_seed(5)) != []

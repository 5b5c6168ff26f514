"""Plain decode steps through the flat loop (gpu_worker/model/flat_decode.py) give the module
tree's logits bit for bit, and only the steps it serves take it.

An in-process worker on a random-weight LLaMA with SmolLM2's head dim (64), so that the
C++ kernels take the paths they take for the real model: in bf16 with the widening or the
VNNI linear (whichever the CPU picks), in bf16 with int8 weights, and in float32 with
oneDNN's packed weights. Each workload runs twice on the same worker, with the flat loop
off and on, and every step's logits are compared. The same on two other families
(tests/family_models.py): Gemma 3 (four norms a layer, (1 + w) norms, GeGLU, q/k norms,
head dim 256, local layers with a 12-key window shorter than the prompts), Qwen3 (q/k
norms, head dim 128) and Qwen2-MoE (routed experts and a gated shared expert).
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch

from gpu_worker.model.attention import AttentionMetadata, DecodeGroup, ExtendRow
from gpu_worker.model.decoder_layer import DecoderLayer
from gpu_worker.model.flat_decode import FlatDecodeLoop
from tests.family_models import make_family_checkpoint
from tests.helpers import TEST_CPU_THREADS, WorkerDriver, make_random_llama
from trident.wire.child import ChildContext
from trident.wire.server_args import ServerArgs


@pytest.fixture(scope="module", params=["llama", "gemma3", "qwen3", "qwen2_moe"])
def model_dir(request, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp(request.param))
    if request.param != "llama":
        return make_family_checkpoint(path, request.param)
    return make_random_llama(path, hidden=256, layers=3, heads=4, kv_heads=2, intermediate=512, seed=3)


@pytest.fixture(
    scope="module", params=[("bfloat16", "auto"), ("bfloat16", "int8"), ("float32", "auto")], ids=lambda p: "-".join(p)
)
def worker(request, model_dir):
    from gpu_worker.runtime.worker import Worker

    dtype, weight_dtype = request.param
    args = ServerArgs(
        model_path=model_dir,
        dtype=dtype,
        weight_dtype=weight_dtype,
        max_total_tokens=4096,
        max_running_requests=8,
        run_dir=tempfile.mkdtemp(prefix="trident-test-"),
        cpu_threads=TEST_CPU_THREADS,
    )
    ctx = ChildContext(args, "worker", 0)
    yield Worker(ctx)
    ctx.zmq_ctx.destroy(linger=0)


def _generate_twice(
    worker, prompts: list[np.ndarray], monkeypatch
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """(logits of every step with the modules, the same with the flat loop, flat runs)."""
    model = worker.model
    flat_runs = 0
    real_run = FlatDecodeLoop.run

    def counted_run(self, *args):
        nonlocal flat_runs
        flat_runs += 1
        return real_run(self, *args)

    monkeypatch.setattr(FlatDecodeLoop, "run", counted_run)
    logits: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda _module, _inputs, out: logits.append(out.clone()))
    try:
        by_path = []
        for enabled in (False, True):
            model.use_flat_decode(enabled)
            logits.clear()
            WorkerDriver(worker).generate(prompts, decode_steps=5)
            by_path.append(list(logits))
    finally:
        hook.remove()
        model.use_flat_decode(True)
    return by_path[0], by_path[1], flat_runs


def _assert_same_logits(modules: list[torch.Tensor], flat: list[torch.Tensor]) -> None:
    assert len(modules) == len(flat) == 6  # the prompt step and 5 decode steps
    for step, (a, b) in enumerate(zip(modules, flat, strict=True)):
        assert torch.equal(a, b), f"step {step}: largest difference {(a.float() - b.float()).abs().max().item()}"


def test_flat_decode_gives_the_module_trees_logits_at_one_row_and_ragged_rows(worker, monkeypatch):
    rng = np.random.default_rng(0)
    lone = [rng.integers(100, 5000, 9)]
    ragged = [rng.integers(100, 5000, n) for n in (3, 12, 41, 90, 91)]
    try:
        # One length group (the decode kernel reads ragged rows in place), then several.
        for prompts, ragged_decode in ((lone, True), (ragged, True), (ragged, False)):
            worker.state.ragged_decode = ragged_decode
            modules, flat, flat_runs = _generate_twice(worker, prompts, monkeypatch)
            _assert_same_logits(modules, flat)
            assert flat_runs == 5, "the decode steps, not the prompt step, take the flat loop"
    finally:
        worker.state.ragged_decode = True


def test_flat_decode_with_torch_attention_matches_the_modules_with_torch_attention(worker, monkeypatch):
    model = worker.model
    kernel = model.decode_kernel
    assert kernel is not None, "the CPU worker uses the C++ decode attention by default"
    model.use_decode_kernel(None)  # drops the flat loop built with the kernel
    # As with --decode-attention torch: prompt chunks go to SDPA, not through the kernel.
    monkeypatch.setattr(worker.state, "every_query_through_kernel", False)
    try:
        rng = np.random.default_rng(1)
        prompts = [rng.integers(100, 5000, n) for n in (5, 30, 31)]
        modules, flat, flat_runs = _generate_twice(worker, prompts, monkeypatch)
        _assert_same_logits(modules, flat)
        assert flat_runs == 5
    finally:
        model.use_decode_kernel(kernel)


def test_the_module_paths_residual_adds_in_the_norms_give_the_bits_of_separate_adds(worker, monkeypatch):
    """Eager steps through the modules hand each layer's residual add to the next layer's input
    norm (DecoderLayer.forward_deferred, add_rms_norm); a separate add then rms_norm, as the
    layers chained through their own forward do, gives the same logits, prompt steps included."""
    deferred = DecoderLayer.forward_deferred

    def separate_adds(self, x, pending, rotary, kv_cache, meta):
        if pending is not None:
            x = x + pending
        return deferred(self, x, None, rotary, kv_cache, meta)

    rng = np.random.default_rng(2)
    prompts = [rng.integers(100, 5000, n) for n in (7, 33, 64)]
    model = worker.model
    logits: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda _module, _inputs, out: logits.append(out.clone()))
    try:
        model.use_flat_decode(False)
        WorkerDriver(worker).generate(prompts, decode_steps=3)
        folded = list(logits)
        logits.clear()
        monkeypatch.setattr(DecoderLayer, "forward_deferred", separate_adds)
        WorkerDriver(worker).generate(prompts, decode_steps=3)
    finally:
        hook.remove()
        model.use_flat_decode(True)
    assert len(folded) == len(logits) == 4
    for step, (a, b) in enumerate(zip(folded, logits, strict=True)):
        assert torch.equal(a, b), f"step {step}: largest difference {(a.float() - b.float()).abs().max().item()}"


def _meta(queries_per_row: int, extend: bool) -> AttentionMetadata:
    rows = 2
    group = DecodeGroup(
        token_idx=torch.zeros(rows, queries_per_row, dtype=torch.int64),
        q_valid=torch.ones(rows, queries_per_row, dtype=torch.bool),
        kv_indices=torch.zeros(rows, 4, dtype=torch.int64),
        kv_lens=torch.full((rows,), 4),
        bias=torch.zeros(rows, 1, queries_per_row, 1, 4),
        covers_batch=queries_per_row == 1,
    )
    extend_rows = [ExtendRow(0, 3, 0, torch.arange(3), None)] if extend else []
    return AttentionMetadata(torch.zeros(rows, dtype=torch.int64), [group], extend_rows)


def test_only_plain_decode_steps_take_the_flat_loop():
    assert _meta(1, extend=False).is_plain_decode()
    assert not _meta(3, extend=False).is_plain_decode(), "a draft to verify attends to its own tokens"
    assert not _meta(1, extend=True).is_plain_decode(), "a prompt chunk attends to this step's k/v"

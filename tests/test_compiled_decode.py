"""Compiled decode steps (`--compile`) sample exactly what eager ones do, and the start-up
warm-up leaves nothing to compile while serving.

One in-process worker on a tiny random-weight LLaMA in float32: its decode steps run once
through the compiled layer and once eager (the same worker, `model.decode_layer` swapped),
on a lone row and on ragged rows that fall into several length groups. Compiling is slow
(the warm-up builds every shape class), so one test pays it once per model.
The same on Gemma 3 (tests/family_models.py): sliding-window and global layers with their
own ropes, four norms a layer, GeGLU, q/k norms, head dim 256.
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest

from gpu_worker.runtime.batch_state import group_by_length
from tests.helpers import TEST_CPU_THREADS, WorkerDriver
from trident.wire.child import ChildContext
from trident.wire.server_args import ServerArgs


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def compiled_worker(request, tmp_path_factory):
    from gpu_worker.runtime.worker import Worker
    from tests.family_models import make_family_checkpoint
    from tests.helpers import make_random_llama

    path = str(tmp_path_factory.mktemp(request.param))
    if request.param == "llama":
        model = make_random_llama(path, seed=5, scale=0.5)
    else:
        model = make_family_checkpoint(path, request.param, seed=5)
    args = ServerArgs(
        model_path=model,
        dtype="float32",
        compile_decode="on",
        max_total_tokens=4096,
        max_running_requests=8,
        run_dir=tempfile.mkdtemp(prefix="trident-test-"),
        cpu_threads=TEST_CPU_THREADS,
    )
    ctx = ChildContext(args, "worker", 0)
    yield Worker(ctx)
    ctx.zmq_ctx.destroy(linger=0)  # before the garbage collector would, with sockets still open


def test_compiled_decode_samples_what_eager_does_and_compiles_nothing_after_warm_up(compiled_worker):
    from torch._dynamo.utils import counters

    worker = compiled_worker
    assert worker.compiled and worker.model.decode_layer is not None
    rng = np.random.default_rng(0)
    lone = [rng.integers(100, 5000, 9)]
    ragged = [rng.integers(100, 5000, n) for n in (3, 4, 12, 13, 40, 41, 90, 91)]
    assert len(group_by_length(np.array([len(p) for p in ragged]))) == 4  # every length group in play
    # A one-row group among others runs eager (compiled_decode.runs_compiled): no compile either.
    with_lone_group = [rng.integers(100, 5000, n) for n in (3, 4, 90)]
    compiled_fn = worker.model.decode_layer
    graphs_after_warm_up = counters["stats"]["unique_graphs"]
    driver = WorkerDriver(worker)
    # With the decode kernel, ragged rows decode as one group; without ragged decoding they
    # fall into length groups (the path of the torch attention), each served by the kernel.
    assert worker.state.ragged_decode
    for prompts, ragged_decode in ((lone, True), (ragged, True), (ragged, False), (with_lone_group, False)):
        worker.state.ragged_decode = ragged_decode
        compiled = driver.generate(prompts)
        worker.model.decode_layer = None
        eager = driver.generate(prompts)
        worker.model.decode_layer = compiled_fn
        np.testing.assert_array_equal(compiled, eager)
        assert len(set(eager[:, 1:].ravel().tolist())) > 1  # the model does not just repeat one token
    assert counters["stats"]["unique_graphs"] == graphs_after_warm_up, "a decode step compiled after warm-up"


def test_compile_is_asked_for_and_runs_at_tp_1_only():
    from gpu_worker.model.compiled_decode import wants_compile

    assert wants_compile("on", 1)
    assert not wants_compile("auto", 1) and not wants_compile("off", 1)
    assert not wants_compile("on", 2)

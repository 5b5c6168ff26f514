"""Shared fixtures: one real SmolLM2 server (float32, checks on) for the API tests; the
order in which files start, and which share a pytest process; a directory the processes share."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

from gpu_worker.runtime.omp_policy import use_passive_omp_wait
from trident.child_process import CHILD_ENV_DEFAULTS

# Before numpy and torch are imported, for the references and in-process workers that tests
# run: the settings the launcher gives its children and the worker takes (omp_policy.py).
# The two pytest processes share 2 cores with the servers they start.
for key, value in CHILD_ENV_DEFAULTS.items():
    os.environ.setdefault(key, value)
use_passive_omp_wait()

import pytest  # noqa: E402

from tests.helpers import SHARED_DIR_ENV, Server, smollm2_gguf  # noqa: E402

LONGEST_FILES_FIRST = (
    "test_fast_path_vs_transformers.py",
    "test_gemma3_270m.py",
    "test_gpu_check.py",
    "test_compare_moe.py",
    "test_structured_outputs.py",
    "test_model_families.py",
    "test_overlap_and_speculative.py",
    "test_tensor_parallel.py",
    "test_chaos.py",
    "test_faults.py",
    "test_data_parallel_and_multi_node.py",
    "test_batch_invariance_served.py",
    "test_load.py",
    "test_parity_with_transformers.py",
)
"""The files that take longest (a run's --durations, summed per file), in that order. The two
pytest processes take whole files in collection order (`--no-loadscope-reorder`: xdist would
order them by their number of tests), so these go first: a long file started last would run
on alone while the other process idles."""


def pytest_configure(config: pytest.Config) -> None:
    """A parallel run's controller makes the directory its pytest processes share (they start
    after this, with its environment). Each of those processes computes on one thread
    (helpers.TEST_CPU_THREADS says why): the two fill the 2 cores between them."""
    if hasattr(config, "workerinput"):
        import torch

        torch.set_num_threads(1)
    elif config.getoption("numprocesses", default=None):
        os.environ[SHARED_DIR_ENV] = tempfile.mkdtemp(prefix="trident-tests-shared-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and SHARED_DIR_ENV in os.environ:
        shutil.rmtree(os.environ.pop(SHARED_DIR_ENV), ignore_errors=True)


RUN_WITH = {"test_gemma3_270m.py": "test_fast_path_vs_transformers.py"}
"""file -> the file whose pytest process runs it too: both take transformers' float32 Gemma 3
reference (helpers.transformers_float32, cached per process), which takes a minute to load."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Whole files to each process, as `--dist loadfile` does, but a file of RUN_WITH goes with
    its partner (it must follow it in LONGEST_FILES_FIRST), and a process gets its next file
    only when it is about to wait for one."""
    from xdist.scheduler import LoadFileScheduling
    from xdist.workermanage import WorkerController

    class SharedReferenceScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            name = file.rpartition("/")[2]
            return file.removesuffix(name) + RUN_WITH[name] if name in RUN_WITH else file

        def _reschedule(self, node: WorkerController) -> None:
            """The next file goes to a process once its last test is all it has left, not with
            two left as xdist's heuristic has it: a file handed over while the second-to-last
            test runs waits behind that test and the last (compare_moe's two smoke runs), and at
            the end of the queue the other process idles meanwhile with nothing to take. A
            process holds back its last test until it knows the next (or shutdown), so with one
            pending it is waiting, and gets the next file at once."""
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
            elif self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    return SharedReferenceScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FILES_FIRST.index(name) if name in LONGEST_FILES_FIRST else len(LONGEST_FILES_FIRST)

    items.sort(key=rank)  # stable: tests keep their order within a file


@pytest.fixture
def worker_threads() -> Iterator[None]:
    """The test computes on as many threads as a lone worker takes here, whatever the run's
    setting (one per pytest process in a parallel run): how the C++ kernels split rows and
    columns across threads is part of what they are checked for."""
    import torch

    from gpu_worker.runtime.worker import cpu_threads_per_worker
    from trident.wire.server_args import ServerArgs

    threads = torch.get_num_threads()
    torch.set_num_threads(cpu_threads_per_worker(ServerArgs(model_path="")))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_server():
    """The default model as a user starts it, in float32 so greedy text equals the reference."""
    server = Server(["--dtype", "float32", "--max-total-tokens", "16384", "--check-seq-lens"])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2_plain_loop_server():
    """The default model in float32 with overlap off; restarts are tested on it, so it is kept
    apart from `smollm2_server`."""
    server = Server(["--dtype", "float32", "--max-total-tokens", "16384", "--check-seq-lens", "--disable-overlap"])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def hf_reference(smollm2_path):
    """Hugging Face transformers on the same GGUF, float32: the correctness reference."""
    import os

    from transformers import AutoTokenizer

    from tests.helpers import transformers_float32

    d, name = os.path.dirname(smollm2_path), os.path.basename(smollm2_path)
    return AutoTokenizer.from_pretrained(d, gguf_file=name), transformers_float32(smollm2_path)


@pytest.fixture(scope="session")
def fault_model(tmp_path_factory) -> str:
    """A random-weight LLaMA (4 heads, 2 KV heads: splits at tp 2) for the workload tests."""
    from tests.helpers import make_random_llama

    return make_random_llama(str(tmp_path_factory.mktemp("fault_llama")), hidden=128, layers=4, seed=4)


@pytest.fixture(scope="session")
def fault_server_and_reference(fault_model):
    """One tp 1, dp 1 server at the workload's flags, and `tests.workload`'s outputs from it
    before anything disturbed it. The fault tests that share the server leave it serving and
    count only their own restarts and frames."""
    from tests.helpers import running_server
    from tests.workload import BASE, run_with_fault

    with running_server(["--model", fault_model, *BASE]) as server:
        yield server, run_with_fault(server, None)


@pytest.fixture(scope="session")
def fault_server(fault_server_and_reference):
    return fault_server_and_reference[0]


@pytest.fixture(scope="session")
def fault_reference(fault_server_and_reference) -> list[list[int]]:
    """`tests.workload`'s outputs from one undisturbed tp 1, dp 1 server."""
    return fault_server_and_reference[1]

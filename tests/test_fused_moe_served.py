"""The fused MoE op (layers/fused_moe.py) as the worker installs it: a bf16 mixture-of-experts
model's routed experts run on it (linear_plan.py's `choose_experts`), and the ready line says so.

The random Qwen3-MoE, Qwen2-MoE and Mixtral checkpoints of the family tests (family_models.py):
- through the model, bf16 prompt logits on the fused op are within a bound of the torch
  experts path's (the same bf16 model, each expert's own linear layers), and as close to
  transformers in float32 as transformers' own bf16 is, within a margin;
- served in bf16 (Qwen2-MoE: routed and shared experts), at tp 1 and tp 2 (each rank's
  experts a slice of the intermediate dimension, which the op pads): the ready line names
  the fused path, and each prompt's greedy tokens are the same alone and in a crowd.
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels.cpu_kernels import load_fused_moe
from gpu_worker.layers.fused_moe import fused_moe_available
from gpu_worker.layers.linear_plan import fused_experts
from tests.family_models import MOE_CHECKPOINTS, make_family_checkpoint
from tests.helpers import prompt_logits, running_server
from tests.test_batch_invariance_served import alone, in_a_crowd, text_prompts

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not fused_moe_available(), reason="the fused MoE op's kernels do not build on this CPU"),
]

FUSED_VS_TORCH_EXPERTS = 0.25
"""Max |logit difference| between the fused op and the torch experts path, both bf16: they
round in different places (the op keeps the down projection in float32), which moves logits
of magnitude up to about 8 by a few bf16 steps (measured: about 0.1)."""
FLOAT32_MARGIN = 1.25
"""The fused op's max |logit difference| from float32 transformers, at most this many times
transformers' own bf16's (measured: within a few percent of it)."""


@pytest.mark.parametrize("name", MOE_CHECKPOINTS)
def test_fused_experts_logits_are_near_the_torch_experts_and_float32_transformers(name, tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_family_checkpoint(str(tmp_path / name), name)
    ids = torch.randint(100, 40000, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fused = prompt_logits(path, ids, torch.bfloat16, fused_experts).float()
        torch_experts = prompt_logits(path, ids, torch.bfloat16).float()
        want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids[None]).logits[0]
        hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()(ids[None]).logits[0]
    assert (fused - torch_experts).abs().max() <= FUSED_VS_TORCH_EXPERTS
    hf_error = (hf_bf16.float() - want).abs().max()
    assert (fused - want).abs().max() <= FLOAT32_MARGIN * hf_error


def _fused_kind() -> str:
    return f"experts fused-{load_fused_moe().replace('_', '-')}"


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory) -> str:
    return make_family_checkpoint(str(tmp_path_factory.mktemp("qwen2_moe")), "qwen2_moe")


@pytest.mark.parametrize("tp", [1, 2])
def test_a_served_bf16_moe_model_runs_its_experts_fused_and_batch_invariant(qwen2_moe, tp):
    prompts = text_prompts()[:3] if tp == 2 else text_prompts()
    with running_server(["--model", qwen2_moe, "--tp-size", str(tp), "--chunked-prefill-size", "24"]) as server:
        ready = next(line for line in server.output if "worker[tp0] ready" in line)
        assert "weights bf16" in ready and _fused_kind() in ready and "not batch invariant" not in ready, ready
        reference = alone(server, prompts)
        assert len({tuple(tokens) for tokens in reference}) == len(prompts), "the prompts' texts differ"
        assert in_a_crowd(server, prompts, 3) == reference

"""The worker builds its model in the dtype it serves (gguf_layers.weights_left_uninitialised):
a bf16 model never passes through a float32 copy of itself, and loads to the same bits as one
built in float32 and cast afterwards."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.layers.gguf_layers import weights_left_uninitialised
from gpu_worker.model.decoder import LlamaForCausalLM
from gpu_worker.model.weights import iter_weights, load_config
from tests.helpers import make_random_llama


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_built_in_its_dtype_loads_the_bits_of_one_built_in_float32_and_cast(tmp_path, dtype):
    path = make_random_llama(str(tmp_path / "llama"))
    cfg = load_config(path)
    with weights_left_uninitialised(dtype):
        model = LlamaForCausalLM(cfg)
    assert torch.get_default_dtype() == torch.float32
    assert {p.dtype for p in model.parameters()} == {dtype}, "no parameter allocated in float32"
    assert {b.dtype for rope in model.rope for b in rope.buffers()} == {torch.float32}, "rope tables as computed"
    model.load_weights(iter_weights(path, cfg, False))

    with weights_left_uninitialised(torch.float32):
        reference = LlamaForCausalLM(cfg)
    reference.load_weights(iter_weights(path, cfg, False))
    reference = reference.to(dtype)
    ours, theirs = model.to(dtype).state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_the_default_dtype_comes_back_when_building_fails():
    with pytest.raises(RuntimeError, match="no such model"), weights_left_uninitialised(torch.bfloat16):
        raise RuntimeError("no such model")
    assert torch.get_default_dtype() == torch.float32
    assert torch.nn.Linear(2, 2).weight.abs().sum() > 0, "random initialisation is back too"

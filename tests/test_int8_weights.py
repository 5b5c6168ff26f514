"""Weight-only int8 (`--weight-dtype int8`): the kernel computes what the dequantized
weights would, and SmolLM2 with int8 weights predicts nearly what it does in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.layers.int8_weights import Int8Linear, quantize_per_channel
from gpu_worker.layers.linear_plan import every_linear
from tests.helpers import make_random_llama, prompt_logits, running_server, smollm2_tokenizer

TEXT = (
    "The capital of France is Paris. It is known for the Eiffel Tower, museums such as the Louvre, and its cafes. "
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    "Once upon a time, in a small village, there lived an old baker who made bread every morning."
)


def test_per_channel_quantization_is_within_half_a_step_of_each_weight():
    w = torch.randn(96, 64) * torch.logspace(-3, 1, 96)[:, None]  # rows of very different ranges
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    # Half a step, plus float32's rounding of w / scale and q * scale (relative to w: an
    # absolute 1e-7 failed now and then on rows of w ~ 10).
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 2**-20 * w.abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_equals_a_linear_layer_with_the_dequantized_weights(dtype):
    w, b, x = torch.randn(48, 64, dtype=dtype), torch.randn(48, dtype=dtype), torch.randn(2, 5, 64, dtype=dtype)
    layer = Int8Linear(w, b)
    q, scale = quantize_per_channel(w)
    want = F.linear(x.float(), q.float() * scale.to(dtype).float()[:, None], b.float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(layer(x).float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("out_features, in_features", [(1536, 576), (576, 1536), (49152, 576)])
def test_an_int8_rows_output_is_the_same_bits_at_any_batch_size(out_features, in_features):
    """Batch invariance (gpu_worker/runtime/batch_invariance.py) counts on torch's int8 kernel
    summing each row alone, in one order: SmolLM2's shapes, 1 to 130 rows."""
    gen = torch.Generator().manual_seed(out_features)
    layer = Int8Linear(torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16), None)
    x = torch.randn(130, in_features, generator=gen).to(torch.bfloat16)
    together = layer(x)
    for rows in (1, 7, 8, 33, 64, 65):
        assert torch.equal(layer(x[:rows]), together[:rows]), rows
    assert all(torch.equal(layer(x[i : i + 1])[0], together[i]) for i in range(0, 130, 9))


def test_smollm2_with_int8_weights_predicts_nearly_what_float32_does(smollm2_path):
    tok = smollm2_tokenizer()
    ids = torch.tensor(tok(TEXT).input_ids)
    reference = prompt_logits(smollm2_path, ids, torch.float32).float()
    int8 = prompt_logits(smollm2_path, ids, torch.bfloat16, every_linear(Int8Linear)).float()
    # bf16 weights agree on 98.8 % of these 85 positions, int8 on 96.5 % (measured).
    assert (int8.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
    assert F.cosine_similarity(int8, reference, dim=-1).min() >= 0.98


def test_a_server_started_with_int8_weights_generates(tmp_path):
    model = make_random_llama(str(tmp_path / "model"), seed=3)
    with running_server(["--model", model, "--dtype", "bfloat16", "--weight-dtype", "int8"]) as server:
        r = server.http().post(
            "/generate",
            json={
                "text": "one two three",
                "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
            },
        )
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 12

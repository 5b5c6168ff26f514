"""GGUF blocks -> our U4/I8 layouts (gpu_worker/layers/gguf_repack.py) lose nothing: for every
format in the table, on random blocks and on every such tensor of both packaged files,
scale * code (+ min) is the float32 that `gguf.quants.dequantize` gives. Q5_0 keeps its 5
bits (the I5 layout), Q6_K its 6 (I6), and their kernels stay within their activations'
rounding of them.

Bitwise, with one exception by construction: Q4_0's zero weights (code 8) come out +0.0
from d * 8 + (-8 d) where gguf's d * (8 - 8) gives -0.0 for a negative d. Equal values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from gpu_worker.kernels.cpu_kernels import load_quant_linear
from gpu_worker.layers.gguf_layers import narrow, quant_linear
from gpu_worker.layers.gguf_repack import I8_FORMATS, U4_FORMATS, I8Weights, U4Weights, concat_rows, repack
from gpu_worker.layers.quant_linear import I5, I6
from gpu_worker.model.gguf_header import read_gguf_header, tensor_bytes
from tests.helpers import smollm2_gguf

Q = GGMLQuantizationType
FP16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q4_K: (0, 2), Q.Q8_0: (0,), Q.Q5_0: (0,), Q.Q6_K: (208,)}
"""Byte offsets of each format's fp16 fields (d, and m / dmin), set to finite values."""
ROWS_PER_CHECK = 8192
"""Rows dequantized at a time on the real tensors (Gemma's embedding is 262k rows)."""
BEST_PATH = load_quant_linear()
KERNEL_PATHS = {
    "amx_int8": ("amx_int8", "avx512_vnni", "avx2"),
    "avx512_vnni": ("avx512_vnni", "avx2"),
    "avx2": ("avx2",),
    "": (),
}[BEST_PATH]


def assert_same_float32(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ref.dtype == np.float32 and ours.shape == ref.shape
    assert np.isfinite(ref).all()
    same_bits = ours.view(np.uint32) == ref.view(np.uint32)
    assert (same_bits | ((ours == 0) & (ref == 0))).all(), f"{np.count_nonzero(~same_bits)} values differ"


def random_tensor(kind: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    elements, block_bytes = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(rows * cols // elements, block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[kind]:
        # Signs, tiny (subnormal fp16) and large scales; random bytes could make inf/NaN.
        scale = rng.choice([1e-6, 1e-3, 0.05, 3.0], size=len(blocks)) * rng.standard_normal(len(blocks))
        blocks[:, offset : offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", [*U4_FORMATS, *I8_FORMATS], ids=lambda k: k.name)
def test_random_blocks_repack_to_gguf_dequantization_exactly(kind):
    rng = np.random.default_rng(int(kind))
    rows, cols = 64, 512
    raw = random_tensor(kind, rows, cols, rng)
    weights = repack(raw, kind, (rows, cols))
    assert isinstance(weights, U4Weights if kind in U4_FORMATS else I8Weights)
    assert weights.shape == (rows, cols)
    if isinstance(weights, U4Weights):
        assert weights.codes.dtype == np.uint8 and weights.codes.max() <= 15
    assert_same_float32(weights.dequantize(), dequantize(raw, kind))


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_every_tensor_of_the_packaged_files_repacks_exactly(model):
    from tests.test_fast_path_vs_transformers import gemma_gguf

    path = smollm2_gguf() if model == "smollm2" else gemma_gguf()
    file = np.memmap(path, dtype=np.uint8, mode="r")
    checked: dict[str, int] = {}
    for t in read_gguf_header(path).tensors:
        kind = Q(t.ggml_type)
        if len(t.shape) != 2:
            continue
        assert kind in U4_FORMATS or kind in I8_FORMATS, f"{t.name} is {kind.name}: the packaged files need no fallback"
        raw = tensor_bytes(file, t)
        for start in range(0, t.shape[0], ROWS_PER_CHECK):
            part = raw[start : start + ROWS_PER_CHECK]
            weights = repack(part, kind, (part.shape[0], t.shape[1]))
            assert_same_float32(weights.dequantize(), dequantize(part, kind))
        checked[kind.name] = checked.get(kind.name, 0) + 1
    expected = {"smollm2": {"Q4_1": 210, "Q8_0": 1}, "gemma3": {"Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}}
    assert checked == expected[model]


def test_formats_outside_the_table_have_no_layout():
    raw = np.zeros((4, 24 * 2), dtype=np.uint8)  # Q5_1: 24 bytes a block of 32
    assert repack(raw, Q.Q5_1, (4, 64)) is None


def test_stacked_and_split_weights_dequantize_to_the_stacked_and_split_rows():
    rng = np.random.default_rng(0)
    q8 = repack(random_tensor(Q.Q8_0, 16, 256, rng), Q.Q8_0, (16, 256))
    q6 = repack(random_tensor(Q.Q6_K, 8, 256, rng), Q.Q6_K, (8, 256))
    fused = concat_rows([q8, q6])
    assert isinstance(fused, I8Weights) and fused.block == 16
    assert_same_float32(fused.dequantize(), np.concatenate([q8.dequantize(), q6.dequantize()]))
    assert_same_float32(fused.columns(64, 128).dequantize(), fused.dequantize()[:, 64:192])
    q4 = repack(random_tensor(Q.Q4_K, 8, 256, rng), Q.Q4_K, (8, 256))
    assert_same_float32(q4.columns(32, 96).dequantize(), q4.dequantize()[:, 32:128])
    with pytest.raises(ValueError, match="do not fall on the 32-element blocks"):
        q4.columns(16, 64)
    with pytest.raises(ValueError, match="different layouts"):
        concat_rows([q4, q8])


def test_q5_0_and_q6_k_keep_their_code_width_alone_and_widen_to_eight_with_a_q8_0_part():
    rng = np.random.default_rng(5)
    q5 = repack(random_tensor(Q.Q5_0, 16, 256, rng), Q.Q5_0, (16, 256))
    q6 = repack(random_tensor(Q.Q6_K, 16, 256, rng), Q.Q6_K, (16, 256))
    q8 = repack(random_tensor(Q.Q8_0, 16, 256, rng), Q.Q8_0, (16, 256))
    assert q5.bits == 5 and q5.codes.min() >= -16 and q5.codes.max() <= 15
    assert q6.bits == 6 and q6.codes.min() >= -32 and q6.codes.max() <= 31
    assert concat_rows([q5, q5]).bits == 5 and narrow(q5, 0, 0, 8).bits == 5 and narrow(q5, 1, 32, 64).bits == 5
    assert concat_rows([q5, q6]).bits == 6 and concat_rows([q5, q6]).block == 16
    fused = concat_rows([q5, q8])  # Gemma 3's q/k/v: Q5_0, Q5_0, Q8_0
    assert fused.bits == 8 and concat_rows([q6, q8]).bits == 8
    assert_same_float32(fused.dequantize(), np.concatenate([q5.dequantize(), q8.dequantize()]))


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize(("kind", "layout", "bits"), [(Q.Q5_0, I5, 5.5), (Q.Q6_K, I6, 8.0)], ids=["Q5_0", "Q6_K"])
def test_q5_0_and_q6_k_served_in_their_own_width_are_within_the_activation_rounding_of_gguf(path, kind, layout, bits):
    """The layer the loader builds for the tensor (I5, I6) against a float64 matmul of the
    weights as gguf dequantizes them, on random blocks, within the int8 activations' rounding."""
    from tests.test_quant_linear import error_bound

    rng = np.random.default_rng(6)
    rows, cols = 100, 512
    raw = random_tensor(kind, rows, cols, rng)
    layer = quant_linear(repack(raw, kind, (rows, cols)), None)
    padded_rows = layer.packed.shape[0] * 16  # whole panels of 16 columns
    assert layer.layout == layout and layer.packed.numel() * 8 / (padded_rows * cols) == bits
    weight = torch.from_numpy(dequantize(raw, kind))
    assert torch.equal(layer.dequantize(), weight)
    layer.kernel_path = path
    for batch in (1, 7, 64):
        x = (torch.randn(batch, cols) * torch.rand(batch, cols).pow(4) * 4).bfloat16()
        reference = x.double() @ weight.double().T
        excess = (layer(x).double() - reference).abs() - error_bound(layer, x, reference)
        assert excess.max() <= 0, f"{batch} rows: over the bound by {excess.max():.3g}"

"""Linear layers on quantized weights (gpu_worker/layers/quant_linear.py, csrc/quant_linear.cpp), in
each layout (U4, I8, I5, I6): the repacking loses nothing, each kernel path is within the
rounding of its int8 activations of a float32 reference on the dequantized weights, the
paths (AMX-INT8, AVX512-VNNI, AVX2) give the same bits, in the AVX-512 build and in the AVX2
build alike, and a row's result does not depend on its batch.

The bound, per output element y = sum_i w_i x_i: the kernel computes sum_i w_i x^_i exactly in
integers per block, where x^ = sx round(x / sx), sx = max|x| / 127 over the row's block of
32, so |x - x^| <= sx / 2 (and a hair: x / sx is itself rounded); then float32 sums one
term a block (a few roundings each), and at the end the output's rounding (bf16: 2^-9)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gpu_worker.kernels.cpu_kernels import load_quant_linear
from gpu_worker.layers.quant_linear import QuantLinear
from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.usefixtures("worker_threads")  # the kernels' split across threads is checked too

BEST_PATH = load_quant_linear()
# Each path a CPU has also has the ones after it.
ALL_PATHS = ("amx_int8", "avx512_vnni", "avx2")
PATHS = list(ALL_PATHS[ALL_PATHS.index(BEST_PATH) :]) if BEST_PATH else []
needs_kernels = pytest.mark.skipif(not BEST_PATH, reason="the quantized kernels need an x86 CPU with AVX2")
needs_vnni = pytest.mark.skipif("avx512_vnni" not in PATHS, reason="this CPU or build has no AVX512-VNNI")
needs_amx = pytest.mark.skipif(
    "amx_int8" not in PATHS,
    reason="this CPU, build or OS has no AMX-INT8 (AMX-TILE and AMX-INT8's TDPBSUD, and the tile state from Linux)",
)


def u4_layer(n: int, k: int, float16_scales: bool, bias: bool = False, seed: int = 0) -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    mins = -torch.rand(n, k // 32, generator=g) * 0.1
    if float16_scales:  # as Q4_0 / Q4_1 ship them; Q4_K's d * sc is no float16
        scales, mins = scales.half().float(), mins.half().float()
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    return QuantLinear.from_u4(codes, scales, mins, torch.randn(n, generator=g) if bias else None)


def i8_layer(n: int, k: int, block: int, float16_scales: bool, bias: bool = False, seed: int = 0) -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, k // block, generator=g) * 0.002 + 1e-4
    if float16_scales:
        scales = scales.half().float()
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    return QuantLinear.from_i8(codes, scales, block, torch.randn(n, generator=g) if bias else None)


def i5_layer(n: int, k: int, float16_scales: bool, bias: bool = False, seed: int = 0) -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    if float16_scales:  # as Q5_0 ships them
        scales = scales.half().float()
    codes = torch.randint(-16, 16, (n, k), dtype=torch.int8, generator=g)
    return QuantLinear.from_i5(codes, scales, torch.randn(n, generator=g) if bias else None)


def i6_layer(n: int, k: int, float16_scales: bool, bias: bool = False, seed: int = 0) -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, k // 16, generator=g) * 0.002 + 1e-4  # Q6_K's d * sc: float32
    if float16_scales:
        scales = scales.half().float()
    codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
    return QuantLinear.from_i6(codes, scales, torch.randn(n, generator=g) if bias else None)


LAYERS = {
    "u4_f16": lambda n, k, bias=False: u4_layer(n, k, True, bias),
    "u4_f32": lambda n, k, bias=False: u4_layer(n, k, False, bias),
    "i8_32_f16": lambda n, k, bias=False: i8_layer(n, k, 32, True, bias),
    "i8_16_f32": lambda n, k, bias=False: i8_layer(n, k, 16, False, bias),
    "i5_f16": lambda n, k, bias=False: i5_layer(n, k, True, bias),
    "i5_f32": lambda n, k, bias=False: i5_layer(n, k, False, bias),
    "i6_f32": lambda n, k, bias=False: i6_layer(n, k, False, bias),
    "i6_f16": lambda n, k, bias=False: i6_layer(n, k, True, bias),
}


def error_bound(layer: QuantLinear, x: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """What the int8 activations, the float32 sums and the output's rounding may cost, per element."""
    xf = x.double()
    rows, k = xf.shape
    block_max = xf.abs().view(rows, k // 32, 32).amax(dim=2)
    half_step = (block_max / 127 / 2 * (1 + 2**-20)).repeat_interleave(32, dim=1)
    w_abs = layer.dequantize().double().abs()
    activation = half_step @ w_abs.T
    float32_sums = (k // 32 + 4) * 2**-23 * ((xf.abs() + half_step) @ w_abs.T)
    if layer.bias is not None:
        float32_sums += 2**-23 * layer.bias.double().abs()
    within = activation + float32_sums
    output = 2**-9 * (reference.abs() + within) if x.dtype == torch.bfloat16 else 0
    return within + output


def reference(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    y = x.double() @ layer.dequantize().double().T
    return y if layer.bias is None else y + layer.bias.double()


@needs_kernels
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", list(LAYERS))
@pytest.mark.parametrize("k", [576, 640, 2048])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_kernel_path_is_within_its_activation_rounding_of_the_float32_reference(path, layout, k, dtype):
    layer = LAYERS[layout](100, k, bias=k == 640)  # 100 columns: 6 panels of 16 and 4 over
    layer.kernel_path = path
    for rows in (1, 3, 32, 64, 300):
        x = (torch.randn(rows, k) * torch.rand(rows, k).pow(4) * 4).to(dtype)  # blocks of uneven range
        y = layer(x)
        assert y.dtype == dtype and y.shape == (rows, 100)
        ref = reference(layer, x)
        excess = (y.double() - ref).abs() - error_bound(layer, x, ref)
        assert excess.max() <= 0, f"{rows} rows: over the bound by {excess.max():.3g}"


@needs_kernels
@pytest.mark.parametrize("layout", list(LAYERS))
def test_a_row_gives_the_same_bits_whatever_its_batch_and_the_thread_count(layout):
    layer = LAYERS[layout](200, 576)
    x = torch.randn(300, 576, dtype=torch.bfloat16)
    whole = layer(x)
    for row in (0, 5, 6, 299):
        assert torch.equal(layer(x[row : row + 1]), whole[row : row + 1])
    for begin, end in ((0, 64), (7, 39), (100, 300)):
        assert torch.equal(layer(x[begin:end]), whole[begin:end])
    threads = torch.get_num_threads()
    assert threads > 1 or len(os.sched_getaffinity(0)) == 1, "`whole` was to split its rows across threads"
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x), whole)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("layout", list(LAYERS))
@pytest.mark.parametrize("k", [576, 1536])
def test_a_prefill_row_has_its_bits_alone_on_every_path_and_is_within_the_reference_bound(layout, k):
    """2,048 rows run in blocks of rows that pass a claim of panels together (and on AMX share
    each panel's decoded codes): a row's bits are still those it has alone, at the blocks'
    edges too, on every path and thread count, and within the float64 reference's bound."""
    layer = LAYERS[layout](100, k, bias=True)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(2048, k, generator=g) * torch.rand(2048, k, generator=g).pow(4) * 4).bfloat16()
    layer.kernel_path = PATHS[0]
    whole = layer(x)
    ref = reference(layer, x)
    excess = (whole.double() - ref).abs() - error_bound(layer, x, ref)
    assert excess.max() <= 0, f"over the bound by {excess.max():.3g}"
    for path in PATHS:
        layer.kernel_path = path
        assert torch.equal(layer(x), whole), f"{path} against {PATHS[0]}"
        for row in (0, 159, 160, 447, 448, 1999, 2047):
            assert torch.equal(layer(x[row : row + 1]), whole[row : row + 1]), f"{path}: row {row} alone"
        for begin, end in ((150, 470), (440, 2048), (13, 1037)):
            assert torch.equal(layer(x[begin:end]), whole[begin:end]), f"{path}: rows {begin}-{end}"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x), whole), "one thread"
    finally:
        torch.set_num_threads(threads)


@needs_vnni
@pytest.mark.parametrize("layout", list(LAYERS))
def test_the_vnni_and_avx2_paths_give_the_same_bits(layout):
    layer = LAYERS[layout](100, 640, bias=True)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(37, 640).to(dtype)
        layer.kernel_path = "avx512_vnni"
        vnni = layer(x)
        layer.kernel_path = "avx2"
        assert torch.equal(layer(x), vnni)


def every_scale_type(n: int, k: int) -> dict[str, QuantLinear]:
    """Each layout and block with float16 and with float32 scales, and a bias."""
    layers = {name: make(n, k, bias=True) for name, make in LAYERS.items()}
    layers["i8_32_f32"] = i8_layer(n, k, 32, False, bias=True)
    layers["i8_16_f16"] = i8_layer(n, k, 16, True, bias=True)
    return layers


@needs_amx
def test_the_amx_vnni_and_avx2_paths_give_the_same_bits_at_every_batch_size_and_thread_count():
    """The AMX tile sums each block's integer dot on TDPBSUD and then runs the VNNI tile's float
    operations in its order: the same bits as the other paths, so a call that takes AMX for
    its whole 16 rows and VNNI for the rest gives every row the bits it has alone."""
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(3)
    for name, layer in every_scale_type(40, 576).items():
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(80, 576, generator=g) * torch.rand(80, 576, generator=g).pow(4) * 4).to(dtype)
            layer.kernel_path = "amx_int8"
            amx = layer(x)
            for other in ("avx512_vnni", "avx2"):
                layer.kernel_path = other
                assert torch.equal(layer(x), amx), f"{name} {dtype}: {other} against amx_int8"
            layer.kernel_path = "amx_int8"
            for rows in range(1, 81):
                assert torch.equal(layer(x[:rows]), amx[:rows]), f"{name} {dtype}: the first {rows} rows"
                begin = 80 - rows
                assert torch.equal(layer(x[begin:]), amx[begin:]), f"{name} {dtype}: the last {rows} rows"
            try:
                torch.set_num_threads(1)
                assert torch.equal(layer(x), amx), f"{name} {dtype}: one thread"
            finally:
                torch.set_num_threads(threads)


def test_the_best_path_follows_the_cpu_flags():
    """Start-up picks the best path the CPU has (on Linux, its flags name each instruction set)."""
    if not BEST_PATH:
        pytest.skip("the quantized kernels did not build here")
    flags = set()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if "amx_int8" in flags and "amx_tile" in flags and "avx512_vnni" in flags:
        assert BEST_PATH == "amx_int8"
    elif "avx512_vnni" in flags:
        assert BEST_PATH == "avx512_vnni"
    layer = LAYERS["u4_f16"](16, 64)
    assert layer.kernel_path == BEST_PATH, "a layer takes that path"


AVX2_BUILD_SCRIPT = """
import sys, torch
from tests.test_quant_linear import LAYERS
from gpu_worker.layers.quant_linear import QuantLinear
x = torch.load(sys.argv[1])
layer = LAYERS["u4_f16"](100, 640, bias=True)
assert layer.kernel_path == "avx2", layer.kernel_path
others = [LAYERS[name](100, 640)(x) for name in ("i8_16_f32", "i5_f16", "i6_f32")]
torch.save([layer(x), *others], sys.argv[2])
"""


@needs_vnni
def test_the_avx2_build_gives_the_same_bits_as_the_avx512_build(tmp_path):
    """torch's dispatch set to AVX2 makes cpu_kernels build (and cache) the AVX2 build, as on an AVX2-only CPU."""
    x = torch.randn(9, 640, dtype=torch.bfloat16)
    torch.save(x, tmp_path / "x.pt")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    res = subprocess.run(
        [sys.executable, "-c", AVX2_BUILD_SCRIPT, str(tmp_path / "x.pt"), str(tmp_path / "y.pt")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    u4, *others = torch.load(tmp_path / "y.pt")
    assert torch.equal(u4, LAYERS["u4_f16"](100, 640, bias=True)(x))
    for name, y in zip(("i8_16_f32", "i5_f16", "i6_f32"), others, strict=True):
        assert torch.equal(y, LAYERS[name](100, 640)(x)), name


def test_dequantize_gives_exactly_scale_times_code_plus_min():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (37, 64), dtype=torch.uint8, generator=g)
    for scales in (torch.rand(37, 2, generator=g).half().float(), torch.rand(37, 2, generator=g) / 3):
        mins = -scales * 8  # Q4_0's min
        layer = QuantLinear.from_u4(codes, scales, mins, None)
        expected = scales.repeat_interleave(32, 1) * codes.float() + mins.repeat_interleave(32, 1)
        assert torch.equal(layer.dequantize(), expected)
    signed = torch.randint(-128, 128, (37, 64), dtype=torch.int8, generator=g)
    for block in (16, 32):
        for scales in (torch.rand(37, 64 // block, generator=g).half().float(), torch.rand(37, 64 // block) / 3):
            layer = QuantLinear.from_i8(signed, scales, block, None)
            assert torch.equal(layer.dequantize(), scales.repeat_interleave(block, 1) * signed.float())
    five_bits = torch.randint(-16, 16, (37, 64), dtype=torch.int8, generator=g)
    for scales in (torch.rand(37, 2, generator=g).half().float(), torch.rand(37, 2, generator=g) / 3):
        layer = QuantLinear.from_i5(five_bits, scales, None)
        assert torch.equal(layer.dequantize(), scales.repeat_interleave(32, 1) * five_bits.float())
    six_bits = torch.randint(-32, 32, (37, 64), dtype=torch.int8, generator=g)
    for scales in (torch.rand(37, 4, generator=g).half().float(), torch.rand(37, 4, generator=g) / 3):
        layer = QuantLinear.from_i6(six_bits, scales, None)
        assert torch.equal(layer.dequantize(), scales.repeat_interleave(16, 1) * six_bits.float())


@needs_kernels
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [5, 6])
def test_i5_and_i6_give_the_bits_of_i8_on_the_same_codes(path, bits):
    """Each reaches the same integer dot per block as I8 and runs the same float operations after it."""
    g = torch.Generator().manual_seed(2)
    block = 32 if bits == 5 else 16
    codes = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (100, 640), dtype=torch.int8, generator=g)
    scales, bias = torch.rand(100, 640 // block, generator=g) / 50, torch.randn(100, generator=g)
    packed = QuantLinear.from_i5(codes, scales, bias) if bits == 5 else QuantLinear.from_i6(codes, scales, bias)
    i8 = QuantLinear.from_i8(codes, scales, block, bias)
    packed.kernel_path = i8.kernel_path = path
    for rows in (1, 2, 5, 8, 9, 64):
        x = torch.randn(rows, 640, generator=g).bfloat16()
        assert torch.equal(packed(x), i8(x))


@pytest.mark.parametrize("path", [*PATHS[:1], ""])
@pytest.mark.parametrize("layout", list(LAYERS))
def test_rows_are_the_dequantized_weight_rows(layout, path):
    layer = LAYERS[layout](70, 576)
    layer.kernel_path = path  # "": the torch fallback
    ids = torch.tensor([0, 15, 16, 69, 3, 3])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(layer.rows(ids, dtype), layer.dequantize()[ids].to(dtype))
    assert torch.equal(layer.rows(ids.view(2, 3), torch.float32), layer.dequantize()[ids])


@needs_kernels
def test_a_row_id_past_the_weight_is_an_error_not_a_read_past_it():
    layer = LAYERS["u4_f16"](20, 64)  # two panels: ids 20 to 31 are padding, 32 past the tensor
    for past in (20, 32):
        with pytest.raises(RuntimeError, match="out of range"):
            layer.rows(torch.tensor([3, past]), torch.float32)


def test_resident_bytes_are_close_to_the_bits_of_the_format():
    n, k = 64, 2048
    bits = {name: make(n, k).packed.numel() * 8 / (n * k) for name, make in LAYERS.items()}
    assert bits == {
        "u4_f16": 5.0,
        "u4_f32": 6.0,
        "i8_32_f16": 8.5,
        "i8_16_f32": 10.0,
        "i5_f16": 5.5,
        "i5_f32": 6.0,
        "i6_f32": 8.0,
        "i6_f16": 7.0,
    }


@pytest.mark.parametrize("layout", ["u4_f32", "i8_16_f32", "i5_f16", "i6_f32"])
def test_the_torch_fallback_is_the_float32_matmul_of_the_dequantized_weights(layout):
    layer = LAYERS[layout](50, 576, bias=True)
    layer.kernel_path = ""
    x = torch.randn(2, 3, 576)
    expected = torch.nn.functional.linear(x, layer.dequantize(), layer.bias)
    assert torch.equal(layer(x), expected)


def test_malformed_weights_are_refused_with_the_shapes_in_the_message():
    with pytest.raises(ValueError, match="k a multiple of 32"):
        QuantLinear.from_u4(torch.zeros(4, 48, dtype=torch.uint8), torch.ones(4, 1), torch.ones(4, 1), None)
    with pytest.raises(ValueError, match="block 16 or 32"):
        QuantLinear.from_i8(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 1), 64, None)
    with pytest.raises(ValueError, match="codes int8"):
        QuantLinear.from_i8(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 2), 32, None)
    with pytest.raises(ValueError, match="-16..15"):
        QuantLinear.from_i5(torch.full((4, 64), 16, dtype=torch.int8), torch.ones(4, 2), None)
    with pytest.raises(ValueError, match="-32..31"):
        QuantLinear.from_i6(torch.full((4, 64), -33, dtype=torch.int8), torch.ones(4, 4), None)


@needs_kernels
def test_an_input_of_the_wrong_width_is_an_error_not_a_crash():
    layer = LAYERS["u4_f16"](16, 64)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.trident.quant_linear(torch.randn(2, 96), layer.packed, None, 16, 0, 32, True, "auto")
    with pytest.raises(RuntimeError):
        layer(torch.randn(2, 96))

"""Every Triton kernel (gpu_worker/kernels/triton/) compiles for an H100 (sm_90) on this
GPU-less machine: triton's own compiler, down to ptxas, in a process without TRITON_INTERPRET.
The interpreter runs a kernel's Python; this checks what only the compiler does (types
through loops and branches, tl.dot's least shapes, registers and shared memory), at the
8B shape's sizes in bf16."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

pytest.importorskip("triton")

COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gpu_worker.kernels.triton.decode_attention import _decode_merge, _decode_split
from gpu_worker.kernels.triton.extend_attention import _extend
from gpu_worker.kernels.triton.rms_norm import _add_rms_norm
from gpu_worker.kernels.triton.rotary_write_kv import _rotary_write_kv

def compile_for_h100(fn, types, constexprs):
    values = iter(types)
    signature = {n: "constexpr" if n in constexprs else next(values) for n in fn.arg_names}
    triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))
    print(fn.__name__, "compiled")

bf, i64, f32 = "*bf16", "*i64", "*fp32"
ints = ["i32"] * 6
compile_for_h100(_decode_split, [bf, bf, i64, i64, i64, f32, f32, "fp32", "i32", *ints],
    dict(HAS_TABLE_ROW=True, GROUP=4, DIM=128, BLOCK_H=16, BLOCK_N=32, BLOCK_D=128, DOT_PRECISION="tf32", NUM_SPLITS=8))
compile_for_h100(_decode_merge, [f32, f32, bf, "i32", "i32"],
    dict(GROUP=4, DIM=128, BLOCK_H=16, BLOCK_D=128, NUM_SPLITS=8))
compile_for_h100(_extend, [bf, bf, i64, bf, "i32", "i32", "fp32", "i32", *ints, "i32", "i32"],
    dict(GROUP=4, DIM=128, BLOCK_M=32, BLOCK_N=32, BLOCK_D=128, DOT_PRECISION="tf32"))
compile_for_h100(_add_rms_norm, [bf, bf, bf, bf, bf, "i32", "fp32"],
    dict(HIDDEN=4096, BLOCK=4096, BLOCK_ROWS=1, HAS_DELTA=True, UNIT_OFFSET=False))
compile_for_h100(_rotary_write_kv, [bf, bf, bf, bf, i64, bf, bf, bf, "fp32", "i32", "i32", "i32", "i32", "i32"],
    dict(HEADS=32, KV_HEADS=8, DIM=128, BLOCK_HEADS=64, HAS_NORM=True, UNIT_OFFSET=False))
"""


def test_every_triton_kernel_compiles_for_an_h100():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"PYTHONPATH": REPO_ROOT, "TRITON_DEFAULT_FP_FUSION": "1"}
    res = subprocess.run([sys.executable, "-c", COMPILE], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("compiled") == 5

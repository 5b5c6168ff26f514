"""The memory floor of one stream on a mixture-of-experts model: the bytes of weights one
token reads over the host's read bandwidth (roofline.py measures it).

A decode step of one sequence reads every attention projection and router, `k` of the `E`
experts of each layer (on average k / E of each stacked expert tensor), the LM head, and one
embedding row; norms and the keys and values so far are left out (a small fraction at the
benchmark's lengths). Counted from the files themselves, so a GGUF's own block formats give
its own bytes: bf16 for a safetensors checkpoint, Q8_0 or other blocks for a GGUF.
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass

import torch
from roofline import BF16_BYTES, memory_read_gb_s


@dataclass
class ActiveBytes:
    """Bytes of weights a token reads, by part."""

    experts: int
    """k of E experts per layer."""
    dense: int
    """Attention projections, routers, LM head, one embedding row."""

    @property
    def total(self) -> int:
        return self.experts + self.dense


def _experts_per_token(config: dict) -> tuple[int, int]:
    return config["num_experts_per_tok"], config.get("num_experts") or config["num_local_experts"]


def checkpoint_active_bytes(checkpoint_dir: str) -> ActiveBytes:
    """Per token, of a bf16 safetensors checkpoint with per-expert names."""
    from safetensors import safe_open

    with open(os.path.join(checkpoint_dir, "config.json")) as f:
        config = json.load(f)
    k, e = _experts_per_token(config)
    experts = dense = 0
    shapes = {}
    for path in sorted(glob.glob(os.path.join(checkpoint_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            shapes |= {key: f.get_slice(key).get_shape() for key in f.keys()}  # noqa: SIM118 (no __iter__)
    tied = "lm_head.weight" not in shapes
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * BF16_BYTES
        if len(shape) < 2:
            continue
        if ".mlp.experts." in name:
            experts += nbytes
        elif name.endswith("embed_tokens.weight"):
            dense += nbytes if tied else nbytes // shape[0]
        else:
            dense += nbytes
    return ActiveBytes(experts * k // e, dense)


def gguf_active_bytes(path: str) -> ActiveBytes:
    """Per token, of a GGUF in its own block formats."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())
    k = int(reader.fields[f"{arch}.expert_used_count"].contents())
    e = int(reader.fields[f"{arch}.expert_count"].contents())
    tensors = {t.name: t for t in reader.tensors}
    tied = "output.weight" not in tensors
    experts = dense = 0
    for name, t in tensors.items():
        if len(t.shape) < 2:
            continue
        if "_exps." in name:
            experts += int(t.n_bytes)
        elif name == "token_embd.weight":
            dense += int(t.n_bytes) if tied else int(t.n_bytes) // int(t.shape[-1])
        else:
            dense += int(t.n_bytes)
    return ActiveBytes(experts * k // e, dense)


def host_read_gb_s(threads: int) -> float:
    """roofline.py's memory read rate on `threads` torch threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return memory_read_gb_s()
    finally:
        torch.set_num_threads(previous)


def memory_floor_tok_s(active: ActiveBytes, read_gb_s: float) -> float:
    """One stream's decode tok/s were every step bound by reading its active weights."""
    return read_gb_s * 1e9 / active.total

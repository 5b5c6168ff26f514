"""Rotary position embeddings: a layer's cos/sin tables from its RopeSpec (rope_spec.py).

The inverse frequencies follow transformers' definitions of each rope type (default,
linear, llama3, yarn), computed in float32 in the same order, so float32 tables carry
the reference's bits. Yarn also scales cos and sin by its attention factor.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gpu_worker.model.rope_spec import RopeSpec


def inv_freq_and_scale(spec: RopeSpec, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the factor on cos and sin."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (spec.theta**exponents)
    if spec.rope_type == "linear":
        return inv_freq / spec.factor, 1.0
    if spec.rope_type == "llama3":
        return _llama3(spec, inv_freq), 1.0
    if spec.rope_type == "yarn":
        return _yarn(spec, head_dim)
    return inv_freq, 1.0


def _llama3(spec: RopeSpec, inv_freq: torch.Tensor) -> torch.Tensor:
    """Long wavelengths divided by factor, short ones kept, a smooth blend between."""
    low_wavelen = spec.original_max_position / spec.low_freq_factor
    high_wavelen = spec.original_max_position / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (spec.original_max_position / wavelen - spec.low_freq_factor) / (
        spec.high_freq_factor - spec.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(spec: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    """Interpolated low frequencies, extrapolated high ones, a linear ramp between."""
    factor = spec.factor
    attention_factor = spec.attention_factor
    if attention_factor is None:
        if spec.mscale and spec.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, spec.mscale) / _yarn_mscale(factor, spec.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(spec.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = spec.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin tables of one RopeSpec indexed by position, in float32 as the reference does."""

    def __init__(self, head_dim: int, spec: RopeSpec | float, max_position: int) -> None:
        """spec: the layer's rope, or just its base (default rope type)."""
        super().__init__()
        spec = spec if isinstance(spec, RopeSpec) else RopeSpec(float(spec))
        inv_freq, scale = inv_freq_and_scale(spec, head_dim)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        self.register_buffer("cos", cos.repeat(1, 2), persistent=False)
        # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: the sign lives in the table.
        self.register_buffer("signed_sin", torch.cat((-sin, sin), dim=-1), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/signed sin for this batch's positions, looked up once per forward, shared by
        every layer of this rope."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.signed_sin[positions].unsqueeze(1).to(dtype)

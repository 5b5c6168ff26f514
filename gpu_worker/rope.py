"""Rotary position embeddings: the parameters of one layer's rope and its cos/sin tables.

The inverse frequencies follow transformers' definitions of each rope type (default,
linear, llama3, yarn), computed in float32 in the same order, so float32 tables carry
the reference's bits. Yarn also scales cos and sin by its attention factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeSpec:
    """One layer's rope, as a checkpoint's rope parameters give it."""

    theta: float = 10000.0
    rope_type: str = "default"
    """One of ROPE_TYPES."""
    factor: float = 1.0
    """linear: positions divided by it; llama3 / yarn: the context extension factor."""
    original_max_position: int = 0
    """llama3 / yarn: the context length the model was trained at."""
    low_freq_factor: float = 1.0
    """llama3 only."""
    high_freq_factor: float = 4.0
    """llama3 only."""
    beta_fast: float = 32.0
    """yarn only."""
    beta_slow: float = 1.0
    """yarn only."""
    attention_factor: float | None = None
    """yarn: cos/sin scale; None: derived from factor (and mscale / mscale_all_dim)."""
    mscale: float = 0.0
    """yarn only."""
    mscale_all_dim: float = 0.0
    """yarn only."""
    truncate: bool = True
    """yarn: round the correction range outwards to whole dimensions."""

    @classmethod
    def from_hf(cls, params: dict, max_position: int) -> RopeSpec:
        """From a transformers rope_parameters (or legacy rope_scaling) dict with its theta."""
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor below 1 is not supported")
        attention_factor = params.get("attention_factor")
        return cls(
            theta=float(params.get("rope_theta", 10000.0)),
            rope_type=rope_type,
            factor=float(params.get("factor") or 1.0),
            original_max_position=int(params.get("original_max_position_embeddings") or max_position),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=None if attention_factor is None else float(attention_factor),
            mscale=float(params.get("mscale") or 0.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
            truncate=bool(params.get("truncate", True)),
        )

    def inv_freq_and_scale(self, head_dim: int) -> tuple[torch.Tensor, float]:
        """Inverse frequencies [head_dim // 2] (float32) and the factor on cos and sin."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            return inv_freq / self.factor, 1.0
        if self.rope_type == "llama3":
            return self._llama3(inv_freq), 1.0
        if self.rope_type == "yarn":
            return self._yarn(head_dim)
        return inv_freq, 1.0

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Long wavelengths divided by factor, short ones kept, a smooth blend between."""
        low_wavelen = self.original_max_position / self.low_freq_factor
        high_wavelen = self.original_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)

    def _yarn(self, dim: int) -> tuple[torch.Tensor, float]:
        """Interpolated low frequencies, extrapolated high ones, a linear ramp between."""
        factor = self.factor
        attention_factor = self.attention_factor
        if attention_factor is None:
            if self.mscale and self.mscale_all_dim:
                attention_factor = _yarn_mscale(factor, self.mscale) / _yarn_mscale(factor, self.mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # the reference's guard against a zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = self.theta ** (torch.arange(0, dim, 2).float() / dim)
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
        inv_freq, scale = spec.inv_freq_and_scale(head_dim)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        self.register_buffer("cos", cos.repeat(1, 2), persistent=False)
        # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: the sign lives in the table.
        self.register_buffer("signed_sin", torch.cat((-sin, sin), dim=-1), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/signed sin for this batch's positions, looked up once per forward, shared by
        every layer of this rope."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.signed_sin[positions].unsqueeze(1).to(dtype)

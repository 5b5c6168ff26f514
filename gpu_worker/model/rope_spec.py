"""The parameters of one layer's rope, as a checkpoint gives them (no torch: launch reads
configs with it before any child starts). rope.py turns a spec into cos/sin tables."""

from __future__ import annotations

from dataclasses import dataclass

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

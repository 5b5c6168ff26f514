"""Reading weights under Hugging Face names: from a GGUF file (gguf_weights.py) or safetensors."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import replace

import torch
from tqdm import tqdm

from gpu_worker.layers.gguf_repack import QuantWeights
from gpu_worker.model.gguf_weights import gguf_config, iter_gguf_weights
from gpu_worker.model.model_config import ModelConfig

logger = logging.getLogger(__name__)


def iter_safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    for file in tqdm(files, desc="Loading safetensors", unit="file", leave=False):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_config(model_path: str) -> ModelConfig:
    if model_path.endswith(".gguf"):
        return gguf_config(model_path)
    cfg = ModelConfig.from_hf_dir(model_path)
    stops = set(cfg.eos_token_ids) | _generation_eos_ids(model_path)
    return replace(cfg, eos_token_ids=tuple(sorted(stops)))


def _generation_eos_ids(path: str) -> set[int]:
    """generation_config.json's eos ids: chat models list their end-of-turn token there
    (Gemma 3: <eos> and <end_of_turn>), not in config.json."""
    try:
        with open(os.path.join(path, "generation_config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError):
        return set()
    return set(eos) if isinstance(eos, list) else ({eos} if isinstance(eos, int) else set())


def iter_weights(
    model_path: str, cfg: ModelConfig, quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantWeights]]:
    """`quantized` (a GGUF only): the file's own formats for the weights gguf_weights.py keeps so."""
    if model_path.endswith(".gguf"):
        return iter_gguf_weights(model_path, cfg, quantized)
    if quantized:
        raise ValueError(f"--weight-dtype gguf needs a .gguf model, not {model_path}")
    return iter_safetensors_weights(model_path)

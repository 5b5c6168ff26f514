"""A model the decoder cannot serve correctly is a one-line error from launch.py (exit 2),
before any child starts: no traceback, no process left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from tests.helpers import REPO_ROOT, make_random_llama, smollm2_gguf


def launch_error(model: str) -> str:
    """launch.py's stderr for `model`, asserting that it is one line and exit code 2."""
    res = subprocess.run(
        [sys.executable, "launch.py", "--model", model], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return make_random_llama(str(tmp_path_factory.mktemp("tiny") / "llama"))


def edited_copy(src: str, dest, config_changes: dict | None = None, drop: str | None = None) -> str:
    """A copy of the checkpoint in `src` with some config fields changed or one tensor left out."""
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f) | (config_changes or {})
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors.pop(drop, None)
    save_file(tensors, os.path.join(dest, "model.safetensors"))
    return str(dest)


def test_unsupported_model_type_names_the_supported_families(tiny_llama, tmp_path):
    gemma1_config = {"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}
    gemma1 = edited_copy(tiny_llama, tmp_path / "gemma1", gemma1_config)
    line = launch_error(gemma1)
    assert "model type 'gemma' is not supported" in line
    assert all(family in line for family in ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3"))


@pytest.mark.parametrize("model_type", ["deepseek_v3", "gpt_oss"])
def test_moe_types_we_do_not_serve_get_one_line(tiny_llama, tmp_path, model_type):
    """DeepSeek's grouped sigmoid routing and gpt-oss's biased experts are not the MoE
    families we serve (qwen3_moe, qwen2_moe, mixtral)."""
    config = {"model_type": model_type, "n_routed_experts": 8, "num_local_experts": 8, "num_experts_per_tok": 2}
    line = launch_error(edited_copy(tiny_llama, tmp_path / model_type, config))
    assert f"model type {model_type!r} is not supported" in line and "qwen3_moe" in line


def test_a_moe_config_over_dense_tensors_is_refused_for_its_missing_experts(tiny_llama, tmp_path):
    config = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    line = launch_error(edited_copy(tiny_llama, tmp_path / "moe", config))
    assert "model.layers.0.mlp.gate.weight and" in line and "missing" in line


def test_a_classifier_checkpoint_is_refused(tiny_llama, tmp_path):
    classifier = edited_copy(tiny_llama, tmp_path / "cls", {"architectures": ["LlamaForSequenceClassification"]})
    assert "holds no text-generation model" in launch_error(classifier)


def test_tensor_shapes_that_do_not_match_the_config_are_refused(tiny_llama, tmp_path):
    wider = edited_copy(tiny_llama, tmp_path / "wider", {"intermediate_size": 256})
    line = launch_error(wider)
    assert "does not match its config" in line
    assert "model.layers.0.mlp.gate_proj.weight has shape [128, 64], the config implies [256, 64]" in line


def test_a_missing_tensor_is_refused(tiny_llama, tmp_path):
    short = edited_copy(tiny_llama, tmp_path / "short", drop="model.layers.1.self_attn.k_proj.weight")
    assert "model.layers.1.self_attn.k_proj.weight missing" in launch_error(short)


def test_qwen3_config_over_llama_tensors_is_refused_for_its_missing_qk_norms(tiny_llama, tmp_path):
    qwen3 = edited_copy(tiny_llama, tmp_path / "qwen3", {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})
    assert "q_norm.weight and 3 more missing" in launch_error(qwen3)


def test_truncated_gguf_is_refused(tmp_path):
    src = smollm2_gguf()
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(os.path.getsize(src) * 3 // 5))
    line = launch_error(str(cut))
    assert "truncated" in line and str(os.path.getsize(src)) in line


def test_unsupported_gguf_architecture_is_refused(tmp_path):
    import gguf
    import numpy as np

    path = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    line = launch_error(path)
    assert "GGUF architecture 'gpt2' is not supported" in line and "gemma3" in line


def test_a_truncated_safetensors_file_is_refused(tiny_llama, tmp_path):
    whole = edited_copy(tiny_llama, tmp_path / "cut")
    weights = os.path.join(whole, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    assert "model.safetensors is truncated" in launch_error(whole)


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma-3-270m"])
def test_the_launcher_resolves_and_checks_a_gguf_without_importing_torch(model):
    """The launcher's own start, before any child exists, is on every server's start path:
    torch's import there would add a second or two to each."""
    code = (
        "import sys\nfrom trident.model_source import resolve_model\n"
        f"resolve_model({model!r})\nprint('torch' in sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"

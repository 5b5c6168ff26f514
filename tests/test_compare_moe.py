"""benchmarks/compare_moe.py's parts that decide what a figure means: the random-weight MoE
checkpoint and its GGUF (the same weights, a tokenizer llama.cpp reads), the bytes a token
reads in each, and a smoke run of the whole path on the tiny shape; the peer engines' runs
are skipped where their venvs are missing, and say which."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import pytest
import torch

from tests.helpers import REPO_ROOT

# The benchmarks are scripts that import their siblings by bare name.
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
from compare_moe import main, missing_peer, parse_args  # noqa: E402
from dense_checkpoint import WEIGHT_STD  # noqa: E402
from moe_floor import checkpoint_active_bytes, gguf_active_bytes  # noqa: E402
from sparse_checkpoint import MOE_SHAPES  # noqa: E402

TINY = MOE_SHAPES["tiny"]

Q8_0_BYTES_PER_WEIGHT = 34 / 32
"""A block of 32 int8 codes and one float16 scale."""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    from compare_moe import model_files

    export_dir = str(tmp_path_factory.mktemp("moe"))
    return model_files(argparse.Namespace(shape="tiny", export_dir=export_dir)) | {"export_dir": export_dir}


def test_the_checkpoint_is_a_qwen3_moe_transformers_reads_whole(files):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(files["checkpoint"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    config = model.config
    assert config.model_type == "qwen3_moe" and config.norm_topk_prob and config.tie_word_embeddings
    assert (config.num_experts, config.num_experts_per_tok) == (TINY.num_experts, TINY.num_experts_per_tok)
    assert (config.moe_intermediate_size, config.head_dim) == (TINY.moe_intermediate_size, TINY.head_dim)
    assert len(AutoTokenizer.from_pretrained(files["checkpoint"])) == config.vocab_size
    up = model.model.layers[1].mlp.experts.gate_up_proj.float()
    assert abs(up.std().item() - WEIGHT_STD) < 0.1 * WEIGHT_STD
    assert torch.equal(model.model.layers[1].input_layernorm.weight, torch.ones(TINY.hidden_size))


def test_the_gguf_holds_the_same_weights_in_q8_0_with_smollm2s_tokenizer(files):
    import gguf
    from safetensors import safe_open

    from gpu_worker.model.model_check import check_model

    reader = gguf.GGUFReader(files["gguf"])
    assert str(reader.fields["general.architecture"].contents()) == "qwen3moe"
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == TINY.vocab_size
    tensors = {t.name: t for t in reader.tensors}
    up = tensors["blk.1.ffn_up_exps.weight"]
    assert up.tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    ours = torch.from_numpy(gguf.quants.dequantize(up.data, up.tensor_type))[3]
    shard = os.path.join(files["checkpoint"], "model-00003-of-00003.safetensors")
    with safe_open(shard, framework="pt") as f:
        theirs = f.get_tensor("model.layers.1.mlp.experts.3.up_proj.weight").float()
    assert (ours - theirs).abs().max().item() < theirs.abs().max().item() / 127  # half a Q8_0 step, with room
    check_model(files["gguf"])


def test_a_token_reads_the_dense_weights_and_k_of_e_experts_of_each_file(files):
    h, d, layers = TINY.hidden_size, TINY.head_dim, TINY.num_hidden_layers
    attention = 2 * TINY.num_attention_heads * d * h + 2 * TINY.num_key_value_heads * d * h
    router = TINY.num_experts * h
    expert = 3 * TINY.moe_intermediate_size * h
    head = TINY.vocab_size * h  # tied: the embedding is the LM head
    bf16 = checkpoint_active_bytes(files["checkpoint"])
    assert bf16.experts == 2 * layers * TINY.num_experts_per_tok * expert
    assert bf16.dense == 2 * (layers * (attention + router) + head)
    q8 = gguf_active_bytes(files["gguf"])
    assert q8.experts == bf16.experts / 2 * Q8_0_BYTES_PER_WEIGHT
    assert q8.dense == math.ceil((layers * attention + head) * Q8_0_BYTES_PER_WEIGHT) + 4 * layers * router


def smoke(engines: str, export_dir: str, tmp_path) -> dict:
    out = str(tmp_path / "smoke.json")
    argv = ["--shape", "tiny", "--export-dir", export_dir, "--engines", engines, "--output-json", out]
    # vLLM on CPU reserves --gpu-memory-utilization of the host's memory up front and refuses to
    # start when that much is not free; the full shape's 0.4 is more than a host running the
    # rest of the suite beside it has, and the tiny model needs a sliver of it. --enforce-eager
    # skips the torch.compile warm-up, most of its start: the smoke run checks the harness's
    # figures, not vLLM's compiled speed.
    vllm_args = "--max-num-seqs 8 --max-model-len 256 --gpu-memory-utilization 0.05 --enforce-eager"
    argv += ["--vllm-args", vllm_args]
    assert main([*argv, "--stream-prompts", "1", "--concurrency", "4", "--output-len", "8"]) == 0
    with open(out) as f:
        return json.load(f)


def test_a_smoke_run_of_trident_reports_every_figure_against_its_floor(files, tmp_path):
    report = smoke("trident-bf16,trident-gguf", files["export_dir"], tmp_path)
    assert set(report["floor_tok_s"]) == {"checkpoint", "gguf"}
    assert report["floor_tok_s"]["gguf"] > report["floor_tok_s"]["checkpoint"]  # Q8_0 reads fewer bytes
    for engine in ("trident-bf16", "trident-gguf"):
        result = report["rounds"][0][engine]
        assert result["one stream"] > 0 and result["4 x 8"] > 0
    assert report["table"].count("\n") == 3


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_a_smoke_run_of_a_peer_engine(engine, files, tmp_path):
    reason = missing_peer(engine, parse_args([]))
    if reason:
        pytest.skip(f"{engine}: {reason}")
    result = smoke(engine, files["export_dir"], tmp_path)["rounds"][0][engine]
    assert "error" not in result, result.get("error")
    assert result["one stream"] > 0 and result["4 x 8"] > 0

"""benchmarks/compare_vllm.py's parts that decide what a figure means: the random-weight
checkpoint both engines serve, the bytes and FLOPs a decode step costs, the floors drawn
from them, and which bench_serving runs each workload name stands for."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.helpers import REPO_ROOT

# The benchmarks are scripts that import their siblings by bare name.
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
from compare_vllm import parse_args, workload_namespaces  # noqa: E402
from dense_checkpoint import SHAPES, WEIGHT_STD, write_random_checkpoint  # noqa: E402
from roofline import HostLimits, ModelCost, markdown_table, model_cost, roofline_rows  # noqa: E402


def test_a_random_checkpoint_has_its_shape_and_its_cost_counts_every_linear_weight_and_the_tied_head(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = write_random_checkpoint("tiny", str(tmp_path / "tiny-bf16"))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    shape, config = SHAPES["tiny"], model.config
    assert (config.hidden_size, config.intermediate_size) == (shape.hidden_size, shape.intermediate_size)
    assert config.num_hidden_layers == shape.num_hidden_layers
    assert config.num_key_value_heads == shape.num_key_value_heads
    assert config.tie_word_embeddings and config.rope_parameters["rope_type"] == "llama3"
    assert len(AutoTokenizer.from_pretrained(directory)) == config.vocab_size
    weight = model.model.layers[0].mlp.up_proj.weight.float()
    assert abs(weight.std().item() - WEIGHT_STD) < 0.1 * WEIGHT_STD

    cost = model_cost("tiny", directory)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]  # lm_head among them, tied
    assert cost.linear_params == sum(m.weight.numel() for m in linears)
    head_dim = shape.hidden_size // shape.num_attention_heads
    assert cost.kv_bytes_per_token == shape.num_hidden_layers * 2 * shape.num_key_value_heads * head_dim * 2

    written = os.path.getmtime(os.path.join(directory, "model.safetensors"))
    write_random_checkpoint("tiny", directory)
    assert os.path.getmtime(os.path.join(directory, "model.safetensors")) == written


def test_each_floor_follows_the_bytes_and_flops_of_a_step_and_the_fraction_takes_the_lower():
    cost = ModelCost("m", 1_000_000_000, hidden_size=2048, intermediate_size=8192, kv_bytes_per_token=1000)
    limits = HostLimits(threads=2, memory_read_gb_s=20.0, matmul_gflop_s={1: 40.0, 64: 400.0, 512: 600.0})
    rows = roofline_rows(cost, limits, context=100, decode_tok_s={"trident": {1: 5.0, 64: 100.0}}, row_counts=[64, 1])

    one, sixty_four = rows
    step_bytes = 2_000_000_000 + 2048 * 2 + 100 * 1000
    assert one.memory_floor_tok_s == pytest.approx(20e9 / step_bytes)
    assert one.compute_floor_tok_s == pytest.approx(600e9 / 2e9)  # the host's peak, whatever the rows
    assert one.fraction(5.0) == pytest.approx(5.0 / min(one.memory_floor_tok_s, one.compute_floor_tok_s))
    step_bytes = 2_000_000_000 + 64 * (2048 * 2 + 100 * 1000)
    assert sixty_four.memory_floor_tok_s == pytest.approx(64 * 20e9 / step_bytes)
    assert sixty_four.compute_floor_tok_s == pytest.approx(600e9 / 2e9)
    assert sixty_four.vllm_tok_s is None and sixty_four.fraction(None) is None

    table = markdown_table(rows).splitlines()
    columns = "model, rows, trident tok/s, vLLM tok/s, memory floor, compute floor, trident fraction, vLLM fraction"
    assert [c.strip() for c in table[0].split("|")[1:-1]] == columns.split(", ")
    assert table[3].startswith("| m | 64 | 100.0 | — |")


def test_each_workload_name_stands_for_its_bench_serving_runs():
    args = parse_args(["--workload", "32x128,mixed,one-stream,rows", "--rows", "1,8"])
    runs = workload_namespaces(args)
    assert list(runs) == ["32x128", "mixed", "one-stream", "rows=1", "rows=8"]
    assert (runs["32x128"].num_prompts, runs["32x128"].max_concurrency) == (64, 32)
    assert runs["32x128"].random_output_len == (128, 128)
    assert (runs["mixed"].dataset, runs["mixed"].num_prompts, runs["mixed"].max_concurrency) == ("mixed", None, None)
    assert (runs["one-stream"].num_prompts, runs["one-stream"].max_concurrency) == (4, 1)
    assert [(runs[k].num_prompts, runs[k].max_concurrency) for k in ("rows=1", "rows=8")] == [(1, 1), (8, 8)]
    with pytest.raises(SystemExit):
        parse_args(["--workload", "32x128,burst"])

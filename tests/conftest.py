"""Shared fixtures: one real SmolLM2 server (float32, checks on) for the API tests."""

from __future__ import annotations

import pytest

from tests.helpers import Server, smollm2_gguf


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_server():
    """The default model as a user starts it, in float32 so greedy text equals the reference."""
    server = Server(["--dtype", "float32", "--max-total-tokens", "16384", "--check-seq-lens"])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def hf_reference(smollm2_path):
    """Hugging Face transformers on the same GGUF, float32: the correctness reference."""
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.dirname(smollm2_path), os.path.basename(smollm2_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    return tok, model

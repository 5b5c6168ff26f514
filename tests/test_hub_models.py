"""`--model org/name` resolved through huggingface_hub's cache, as on a machine that
downloaded the model before: offline (`HF_HUB_OFFLINE=1`), with the Hub unreachable (an
`HF_ENDPOINT` on a closed local port, so nothing waits on a network timeout), GGUF repos by
`--gguf-file` or llama.cpp's `:QUANT`, and one served model through the openai client.

The cache is written the way huggingface_hub lays it out (models--org--name/{blobs, refs/main,
snapshots/COMMIT/...}), its blob a link to the shipped SmolLM2 GGUF."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT, free_port, make_random_llama, running_server, smollm2_gguf
from trident.hub_model import HubName, _chosen_gguf, parse_hub_name
from trident.model_source import ModelNotFound, resolve_tokenizer

REPO = "trident-test/SmolLM2-135M-Instruct-GGUF"
GGUF = "SmolLM2-135M-Instruct-Q4_1.gguf"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> str:
    home = tmp_path_factory.mktemp("hf_home")
    storage = home / "hub" / ("models--" + REPO.replace("/", "--"))
    blob = storage / "blobs" / ("ab" * 32)
    snapshot = storage / "snapshots" / COMMIT
    for d in (blob.parent, snapshot, storage / "refs"):
        d.mkdir(parents=True)
    blob.symlink_to(smollm2_gguf())
    (snapshot / GGUF).symlink_to(os.path.join("..", "..", "blobs", blob.name))
    (storage / "refs" / "main").write_text(COMMIT)
    return str(home)


def _env(hf_home: str, offline: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_HOME"] = hf_home
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    else:  # the Hub "reachable" on a port nobody listens on: refused at once
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    return env


def _resolve(hf_home: str, offline: bool, *calls: tuple[str, str | None]) -> list[str]:
    """resolve_model's answers in a fresh interpreter (huggingface_hub reads its environment
    at import): the path, or the ModelNotFound message."""
    code = (
        "from trident.model_source import ModelNotFound, resolve_model\n"
        f"for name, gguf in {list(calls)!r}:\n"
        "    try:\n        print(resolve_model(name, gguf)[0])\n"
        "    except ModelNotFound as e:\n        print('ModelNotFound:', e)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=_env(hf_home, offline), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().splitlines()


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "hub_unreachable"])
def test_a_hub_name_resolves_to_the_cached_snapshot_without_the_network(hf_home, offline):
    snapshot_file = os.path.join(hf_home, "hub", "models--" + REPO.replace("/", "--"), "snapshots", COMMIT, GGUF)
    got = _resolve(hf_home, offline, (REPO, None), (f"{REPO}:q4_1", None), (REPO, GGUF), (f"{REPO}@main", None))
    assert got == [snapshot_file] * 4


def test_a_model_neither_cached_nor_reachable_stops_with_one_line_naming_the_cache(hf_home):
    got = _resolve(hf_home, False, ("nobody/absent-model", None), (f"{REPO}:Q8_0", None), (REPO, "other.gguf"))
    cache = os.path.join(hf_home, "hub")
    assert got[0].startswith("ModelNotFound: nobody/absent-model@main: the Hub is not reachable") and cache in got[0]
    assert got[1] == f"ModelNotFound: {REPO} has no .gguf file tagged Q8_0; it has {GGUF}"
    assert got[2] == f"ModelNotFound: {REPO} has no file other.gguf; its .gguf files: {GGUF}"


def test_the_launcher_stops_with_that_one_line(hf_home):
    res = subprocess.run(
        [sys.executable, "launch.py", "--model", "nobody/absent-model"], cwd=REPO_ROOT, env=_env(hf_home, False),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("error: nobody/absent-model@main: the Hub is not reachable")
    assert os.path.join(hf_home, "hub") in res.stderr


def test_hub_names_parse_as_llama_cpp_and_vllm_write_them():
    assert parse_hub_name("Qwen/Qwen2.5-0.5B-Instruct") == HubName("Qwen/Qwen2.5-0.5B-Instruct", "main", None)
    assert parse_hub_name("org/name@v1.0:Q4_K_M") == HubName("org/name", "v1.0", "Q4_K_M")
    assert parse_hub_name("smollm2-135m") is None
    assert parse_hub_name("./models/x.gguf") is None


def test_the_quant_tag_picks_the_first_shard_of_its_gguf_and_never_a_projector():
    files = [
        "README.md", "mmproj-model-Q4_K_M.gguf", "model-Q8_0.gguf",
        "model-Q4_K_M-00002-of-00002.gguf", "model-Q4_K_M-00001-of-00002.gguf",
    ]  # fmt: skip
    hub = HubName("org/name", "main", "q4_k_m")
    assert _chosen_gguf(hub, files, None) == "model-Q4_K_M-00001-of-00002.gguf"
    with pytest.raises(ModelNotFound, match="several .gguf files"):
        _chosen_gguf(HubName("org/name", "main", None), files, None)
    assert _chosen_gguf(HubName("org/name", "main", None), ["config.json", "model.safetensors"], None) is None


@pytest.fixture(scope="module")
def hub_server(hf_home):
    saved = dict(os.environ)
    os.environ.update(_env(hf_home, offline=True))
    try:
        with running_server(["--model", f"{REPO}:Q4_1", "--max-total-tokens", "2048"]) as server:
            yield server
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_a_hub_named_model_is_served_under_that_name_through_the_openai_client(hub_server):
    client = hub_server.client()
    assert [m.id for m in client.models.list().data] == [f"{REPO}:Q4_1"]
    reply = client.chat.completions.create(
        model=f"{REPO}:Q4_1", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content and reply.usage.completion_tokens <= 4


TOKENIZER_REPO = "trident-test/smollm2-tokenizer"


@pytest.fixture(scope="module")
def model_without_tokenizer(tmp_path_factory, hf_home) -> str:
    """A random-weight LLaMA whose tokenizer files sit in the Hub cache as their own repo."""
    model = make_random_llama(str(tmp_path_factory.mktemp("no_tokenizer_llama")))
    storage = os.path.join(hf_home, "hub", "models--" + TOKENIZER_REPO.replace("/", "--"))
    snapshot = os.path.join(storage, "snapshots", COMMIT)
    os.makedirs(snapshot)
    os.makedirs(os.path.join(storage, "refs"))
    with open(os.path.join(storage, "refs", "main"), "w") as f:
        f.write(COMMIT)
    for name in os.listdir(model):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.move(os.path.join(model, name), os.path.join(snapshot, name))
    return model


def test_the_tokenizer_flag_takes_a_directory_or_a_hub_repo_and_refuses_neither(hf_home, model_without_tokenizer):
    with pytest.raises(ModelNotFound, match="holds no tokenizer.json"):
        resolve_tokenizer(model_without_tokenizer)
    with pytest.raises(ModelNotFound, match="no such file or directory"):
        resolve_tokenizer("./no/such/tokenizer")
    assert resolve_tokenizer(smollm2_gguf()) == smollm2_gguf()
    code = f"from trident.model_source import resolve_tokenizer; print(resolve_tokenizer({TOKENIZER_REPO!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=_env(hf_home, True), capture_output=True)
    assert done.stdout.decode().strip().endswith(os.path.join("snapshots", COMMIT)), done.stderr.decode()


def test_a_model_without_a_tokenizer_serves_with_vllms_tokenizer_flag(hf_home, model_without_tokenizer):
    """Its text and a constrained request (the worker reads the vocabulary for the grammar
    from the same place)."""
    saved = dict(os.environ)
    os.environ.update(_env(hf_home, offline=True))
    try:
        flags = ["--model", model_without_tokenizer, "--tokenizer", TOKENIZER_REPO, "--max-total-tokens", "2048"]
        with running_server(flags) as server:
            client = server.client()
            choices = ["alpha", "beta"]
            answer = client.chat.completions.create(
                model=client.models.list().data[0].id,
                messages=[{"role": "user", "content": "Pick one."}],
                max_tokens=8,
                extra_body={"guided_choice": choices},
            )
            assert answer.choices[0].message.content in choices
            info = server.http().get("/get_model_info").json()
            assert info["tokenizer_path"].endswith(os.path.join("snapshots", COMMIT))
    finally:
        os.environ.clear()
        os.environ.update(saved)

"""The tokenizer process serves a tokenizer's snapshot (tokenizer_snapshot.py) without
importing transformers, and what it serves is transformers' own: the same ids with and
without special tokens, the same text with and without them skipped, the same token strings
and vocabularies, and the same chat prompts, on SmolLM2's and Gemma 3's GGUF tokenizers and
on a directory with a tool-calling, reasoning-aware template."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from tests.helpers import REPO_ROOT, make_random_llama, smollm2_gguf
from tests.test_chat_templates import with_chat_template

TEXTS = [
    "The capital of France is",
    "  leading spaces, trailing spaces  ",
    "naïve café — 東京 🚀 \u200b tabs\tand\nnewlines\n\n",
    "<|im_start|>user\nHello<|im_end|>",
    "<start_of_turn>model\n<end_of_turn>",
    "def f(x):\n    return x ** 2  # squared",
    "",
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7", "reasoning_content": "small primes: 2, 3, 5, 7"},
        {"role": "user", "content": "Another, with ünïcode?", "name": None},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ],
]

TOOL_TEMPLATE = (
    "{%- if tools %}{{ '<tools>' ~ (tools | tojson) ~ '</tools>\\n' }}{% endif %}"
    "{%- set ns = namespace(turns=0) %}"
    "{%- for m in messages %}{% set ns.turns = ns.turns + 1 %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{%- if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{%- if m.get('thinking') %}[t]{% endif %}"
    "{%- if m.get('content') is not none %}{{ m['content'] }}{% endif %}"
    "{%- for call in m.get('tool_calls', []) %}{{ call['function'] | tojson(indent=1, sort_keys=true) }}{% endfor %}"
    "{%- if m.get('name') is none and 'name' in m %}[name is None]{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
    "{{ '[' ~ ns.turns ~ ' turns, bos ' ~ bos_token ~ ', eos ' ~ eos_token ~ ']' }}"
    "{% generation %}{% endgeneration %}"
    "\n   {% if messages %}{% endif %}"
)
"""Tools through tojson, namespaces, reasoning under both names, a None-valued key (dropped),
a template variable, the special tokens, the {% generation %} tag, and an indented block tag
(lstrip_blocks)."""


def _gemma_gguf() -> str:
    from trident.model_source import packaged_model_path

    return packaged_model_path("gemma-3-270m")


def _directory_with_tool_template(tmp_path) -> str:
    path = make_random_llama(str(tmp_path / "tools"), hidden=64, layers=1, seed=1)
    with_chat_template(path, TOOL_TEMPLATE)
    return path


@pytest.fixture(scope="module", params=["smollm2-gguf", "gemma3-gguf", "tool-template-dir"])
def pair(request, tmp_path_factory):
    """(the tokenizer the server loads, transformers' tokenizer of the same files)."""
    from transformers import AutoTokenizer

    from tokenizer_proc.tokenization import load_tokenizer
    from tokenizer_proc.tokenizer_snapshot import SnapshotTokenizer
    from trident.wire.tokenizer_files import gguf_tokenizer_dir

    if request.param == "tool-template-dir":
        path = _directory_with_tool_template(tmp_path_factory.mktemp("snapshot"))
    else:
        path = smollm2_gguf() if request.param == "smollm2-gguf" else _gemma_gguf()
    ours = load_tokenizer(path)
    assert isinstance(ours, SnapshotTokenizer)
    theirs = AutoTokenizer.from_pretrained(gguf_tokenizer_dir(path) if path.endswith(".gguf") else path)
    theirs.chat_template = ours.chat_template  # Gemma's GGUF has none: both get the turn format
    return ours, theirs


def test_the_snapshot_encodes_as_transformers_does(pair):
    ours, theirs = pair
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text


def test_the_snapshot_decodes_and_names_tokens_as_transformers_does(pair):
    ours, theirs = pair
    specials = sorted(theirs.all_special_ids)
    sequences = [theirs.encode(t) for t in TEXTS] + [specials + theirs.encode("a b") + specials, list(range(300))]
    for ids in sequences:
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), ids
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert ours.decode(5) == theirs.decode(5)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.get_added_vocab() == theirs.get_added_vocab()


def _rendered(tokenizer, chat: list[dict], tools: list[dict] | None, **options) -> str:
    """The prompt, or the template's error (SmolLM2's reads `content`, which a tool-calling
    turn without content no longer has: both raise)."""
    from tokenizer_proc.tokenization import apply_chat_template

    try:
        return apply_chat_template(tokenizer, chat, tools, **options)[0]
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def test_the_snapshot_renders_chat_prompts_as_transformers_does(pair):
    ours, theirs = pair
    for chat in CHATS:
        for generation_prompt in (True, False):
            for kwargs in ({}, {"enable_thinking": False}):
                options = {"add_generation_prompt": generation_prompt, "template_kwargs": kwargs}
                assert _rendered(ours, chat, None, **options) == _rendered(theirs, chat, None, **options)
        assert _rendered(ours, chat, TOOLS) == _rendered(theirs, chat, TOOLS)
    assert "Error" not in _rendered(ours, CHATS[1], TOOLS)


def test_a_template_that_raises_raises_the_same_error():
    import jinja2

    from tokenizer_proc.tokenizer_snapshot import SnapshotTokenizer

    failing = SnapshotTokenizer(None, "{{ raise_exception('no system role') }}", {})
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system role"):
        failing.apply_chat_template([{"role": "system", "content": "x"}])
    escaping = SnapshotTokenizer(None, "{% set ns = namespace(_x=1) %}", {})
    with pytest.raises(jinja2.exceptions.SecurityError):
        escaping.apply_chat_template([])


def test_a_second_start_loads_the_tokenizer_without_importing_transformers(tmp_path):
    path = make_random_llama(str(tmp_path / "model"), hidden=64, layers=1, seed=2)
    with_chat_template(path, f"{uuid.uuid4()}{{{{ messages[0]['content'] }}}}")  # a tokenizer no run has seen
    script = (
        "import sys; from tokenizer_proc.tokenization import load_tokenizer; "
        "t = load_tokenizer(sys.argv[1], without_torch=True); "
        "print(type(t).__name__, 'transformers' in sys.modules, 'torch' in sys.modules)"
    )

    def start() -> str:
        done = subprocess.run([sys.executable, "-c", script, path], cwd=REPO_ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert start() == ["SnapshotTokenizer", "True", "False"]  # the first takes it with transformers, torch hidden
    assert start() == ["SnapshotTokenizer", "False", "False"]


def test_a_changed_template_file_gets_a_new_snapshot(tmp_path):
    from tokenizer_proc.tokenization import load_tokenizer

    path = make_random_llama(str(tmp_path / "model"), hidden=64, layers=1, seed=3)
    for template, rendered in (("A{{ messages[0]['content'] }}", "Ax"), ("B{{ messages[0]['content'] }}!", "Bx!")):
        with_chat_template(path, template)
        load_tokenizer(path)
        assert load_tokenizer(path).apply_chat_template([{"role": "user", "content": "x"}]) == rendered


def test_a_tokenizer_that_cleans_up_its_text_is_served_by_transformers(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tokenizer_proc.tokenization import load_tokenizer
    from tokenizer_proc.tokenizer_snapshot import snapshot_key
    from trident.wire.tokenizer_files import TOKENIZER_CACHE_DIR

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, ".": 3, "don": 4, "'": 5, "t": 6}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    path = str(tmp_path / "wordpiece")
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True
    ).save_pretrained(path)
    for _ in range(2):
        tok = load_tokenizer(path)
        assert type(tok).__name__ != "SnapshotTokenizer"
        assert tok.decode(tok.encode("hello world.")) == "hello world."  # the clean-up joined " ."
    with open(os.path.join(TOKENIZER_CACHE_DIR, "snapshots", snapshot_key(path), "snapshot.json")) as f:
        assert "cleans up" in json.load(f)["unsupported"]


def test_checkpoints_with_the_same_tokenizer_files_share_one_snapshot(tmp_path):
    from tokenizer_proc.tokenizer_snapshot import snapshot_key

    first = make_random_llama(str(tmp_path / "a"), hidden=64, layers=1, seed=4)
    second = make_random_llama(str(tmp_path / "b"), hidden=128, layers=2, seed=5)
    assert snapshot_key(first) == snapshot_key(second)
    with open(os.path.join(second, "tokenizer_config.json"), "a") as f:
        f.write("\n")
    assert snapshot_key(first) != snapshot_key(second)

"""lm-eval's `local-completions` model scores a multiple-choice task against the server (echo
with logprobs: prompt logprobs), and its per-item choices and accuracy equal transformers'
float32 scoring of the same items, tokenized the way lm-eval tokenizes them.

Two servers, because what "equal" can mean depends on the arithmetic:
- the float32 server: every choice's score within float32's summation-order noise of
  transformers', so every item's choice is the same (the task's closest item is decided by
  far more than that noise);
- the default server (the bundled Q4_1 GGUF with its defaults: bfloat16 activations and the
  GGUF kernels' int8 activations). Its scores carry the rounding of that arithmetic, a
  fraction of a nat per choice, so an item whose float32 scores are closer than that is a
  coin toss which its rounding decides; and the rounding differs between hosts (the AVX2
  builds of the kernels and torch's AVX2 ops sum in another order than the AVX-512 ones, and
  an AMX host runs the AVX-512 ones on GGUF weights), so which near tie flips differs too.
  The check: the scores' mean error is that rounding, not a wrong token or position (those
  cost nats); and on the items that float32 decides by more than NEAR_TIE, the accuracy
  equals float32's within 1 item in 40, whatever the host.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers import Server

lm_eval = pytest.importorskip("lm_eval")

TASK = "trident_tiny_multiple_choice"
ITEMS = os.path.join(os.path.dirname(__file__), "data", "tiny_multiple_choice.jsonl")
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""
FLOAT32_ATOL = 2e-2
"""A choice's score (the sum of its tokens' logprobs) against transformers', both float32."""
NEAR_TIE = 0.25
"""Nats between float32's best two choices below which the default server's rounding may
decide an item either way."""
DEFAULT_MEAN_ERROR = 0.25
"""The default server's mean score error, in nats: its rounding, well below what one wrong
token or position costs."""


def load_docs() -> list[dict]:
    with open(ITEMS) as f:
        return [json.loads(line) for line in f]


def transformers_scores(hf_reference, docs: list[dict]) -> list[list[float]]:
    """Each item's choice scores by transformers' float32 log_softmax: the sum of the choice's
    tokens' logprobs after the question, split into tokens as lm-eval splits them. One
    right-padded forward for every choice of every item (causal: padding after a sequence
    changes none of its logits)."""
    tok, model = hf_reference
    seqs, context_lens = [], []
    for doc in docs:
        context = f"Question: {doc['question']}\nAnswer:"
        n_context = len(tok(context, add_special_tokens=False).input_ids)
        for choice in doc["choices"]:
            seqs.append(tok(context + " " + choice, add_special_tokens=False).input_ids)
            context_lens.append(n_context)
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids, attention_mask=mask).logits.float(), dim=-1)
    flat = [
        sum(logprobs[i, p - 1, seq[p]].item() for p in range(n, len(seq)))
        for i, (seq, n) in enumerate(zip(seqs, context_lens))
    ]
    scores, at = [], 0
    for doc in docs:
        scores.append(flat[at : at + len(doc["choices"])])
        at += len(doc["choices"])
    return scores


def lm_eval_scores(server: Server, hf_reference, tmp_path) -> tuple[float, list[list[float]]]:
    """(accuracy, each item's choice scores) of lm-eval's local-completions run on `server`."""
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, items=ITEMS))
    tokenizer = tmp_path / "tokenizer"
    hf_reference[0].save_pretrained(tokenizer)  # lm-eval splits context and choice with it
    model_args = (
        f"model=smollm2-135m,base_url={server.base_url}/v1/completions,"
        f"tokenizer_backend=huggingface,tokenizer={tokenizer},num_concurrent=8,max_retries=1"
    )
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),  # no scan of its own tasks
        batch_size=1,
        log_samples=True,
    )
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return results["results"][TASK]["acc,none"], [[resp[0][0] for resp in s["resps"]] for s in samples]


def choice_of(scores: list[float]) -> int:
    return max(range(len(scores)), key=scores.__getitem__)


def margin_of(scores: list[float]) -> float:
    """How far float32's best choice is ahead of the next one."""
    best, second = sorted(scores)[-2:][::-1]
    return best - second


@pytest.fixture(scope="module")
def default_server():
    """The bundled model as `trident serve` runs it with no flags at all."""
    server = Server([])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def float32_scores(hf_reference) -> list[list[float]]:
    """transformers_scores of every item: one forward of every choice, for both tests."""
    return transformers_scores(hf_reference, load_docs())


def test_lm_eval_on_the_float32_server_makes_every_choice_transformers_float32_makes(
    smollm2_server, hf_reference, float32_scores, tmp_path
):
    docs, expected = load_docs(), float32_scores
    accuracy, served = lm_eval_scores(smollm2_server, hf_reference, tmp_path)
    for item, (got, want) in enumerate(zip(served, expected, strict=True)):
        assert got == pytest.approx(want, abs=FLOAT32_ATOL), item
        assert choice_of(got) == choice_of(want), item
    assert accuracy == sum(choice_of(s) == d["answer"] for s, d in zip(expected, docs)) / len(docs)


def test_lm_eval_on_the_default_server_is_as_accurate_as_transformers_float32_beyond_near_ties(
    default_server, hf_reference, float32_scores, tmp_path
):
    docs, expected = load_docs(), float32_scores
    _, served = lm_eval_scores(default_server, hf_reference, tmp_path)
    errors = [abs(g - w) for got, want in zip(served, expected, strict=True) for g, w in zip(got, want, strict=True)]
    assert sum(errors) / len(errors) < DEFAULT_MEAN_ERROR
    decided = [i for i, scores in enumerate(expected) if margin_of(scores) > NEAR_TIE]
    assert len(decided) >= 0.8 * len(docs)  # the items left out are the few near ties
    served_right = sum(choice_of(served[i]) == docs[i]["answer"] for i in decided)
    float32_right = sum(choice_of(expected[i]) == docs[i]["answer"] for i in decided)
    assert abs(served_right - float32_right) <= 1

"""lm-eval's `local-completions` model scores a multiple-choice task against the server (echo
with logprobs: prompt logprobs), and its accuracy equals transformers' float32 scoring of the
same items, tokenized the way lm-eval tokenizes them."""

from __future__ import annotations

import json
import os

import pytest
import torch

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


def transformers_accuracy(hf_reference, docs: list[dict]) -> float:
    """The task's accuracy by transformers' float32 log_softmax: each choice scored by the sum
    of its tokens' logprobs after the question, split into tokens as lm-eval splits them. One
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
    scores = [
        sum(logprobs[i, p - 1, seq[p]].item() for p in range(n, len(seq)))
        for i, (seq, n) in enumerate(zip(seqs, context_lens))
    ]
    right, at = 0, 0
    for doc in docs:
        mine = scores[at : at + len(doc["choices"])]
        at += len(mine)
        right += max(range(len(mine)), key=mine.__getitem__) == doc["answer"]
    return right / len(docs)


def test_lm_eval_local_completions_accuracy_equals_transformers_float32(smollm2_server, hf_reference, tmp_path):
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, items=ITEMS))
    tokenizer = tmp_path / "tokenizer"
    hf_reference[0].save_pretrained(tokenizer)  # lm-eval splits context and choice with it
    model_args = (
        f"model=smollm2-135m,base_url={smollm2_server.base_url}/v1/completions,"
        f"tokenizer_backend=huggingface,tokenizer={tokenizer},num_concurrent=8,max_retries=1"
    )
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),  # no scan of its own tasks
        batch_size=1,
    )
    served = results["results"][TASK]["acc,none"]
    with open(ITEMS) as f:
        docs = [json.loads(line) for line in f]
    assert abs(served - transformers_accuracy(hf_reference, docs)) <= 1 / len(docs)

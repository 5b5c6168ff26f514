"""`trident run-batch`: OpenAI's batch file format served offline by a real server, as
`vllm run-batch` does. One output line per input line, in order, each as the HTTP route
answers it; a line that cannot be sent says why and the rest still run."""

from __future__ import annotations

import json
import subprocess
import sys

from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion

from tests.helpers import REPO_ROOT

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LINES = [
    {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": QUESTION}},
    {"custom_id": "completion", "url": "/v1/completions", "body": {"prompt": "The sea is", "max_tokens": 5}},
    {"custom_id": "embedding", "method": "POST", "url": "/v1/embeddings", "body": {"input": "The sea"}},
    {"custom_id": "too-hot", "url": "/v1/completions", "body": {"prompt": "Hi", "temperature": 7}},
    {"custom_id": "other-route", "url": "/v1/files", "body": {}},
    {"custom_id": "streamed", "url": "/v1/completions", "body": {"prompt": "Hi", "stream": True}},
    "{not json",
    {"custom_id": "chat-2", "url": "/v1/chat/completions", "body": {"messages": QUESTION, "max_tokens": 3}},
]


def test_a_batch_file_is_answered_line_by_line_in_order_by_the_real_routes(tmp_path):
    for line in LINES:
        if isinstance(line, dict) and line["url"] != "/v1/embeddings":
            line["body"].setdefault("temperature", 0)
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join((json.dumps(line) if isinstance(line, dict) else line) + "\n" for line in LINES))
    results = tmp_path / "results.jsonl"
    command = [sys.executable, "-m", "trident", "run-batch", "-i", str(batch), "-o", str(results)]
    command += ["smollm2-135m", "--dtype", "float32", "--max-total-tokens", "4096", "--max-concurrency", "4"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "run-batch: 8 requests, 4 failed" in done.stderr
    out = [json.loads(line) for line in results.read_text().splitlines()]
    asked = [line.get("custom_id") if isinstance(line, dict) else None for line in LINES]
    assert [o["custom_id"] for o in out] == asked
    by_id = {o["custom_id"]: o for o in out}
    chat = ChatCompletion.model_validate(by_id["chat-1"]["response"]["body"], strict=True)
    assert by_id["chat-1"]["response"]["status_code"] == 200 and "Paris" in chat.choices[0].message.content
    shorter = ChatCompletion.model_validate(by_id["chat-2"]["response"]["body"])
    assert shorter.usage.completion_tokens == 3
    assert chat.choices[0].message.content.startswith(shorter.choices[0].message.content)
    assert Completion.model_validate(by_id["completion"]["response"]["body"]).usage.completion_tokens == 5
    vector = CreateEmbeddingResponse.model_validate(by_id["embedding"]["response"]["body"]).data[0].embedding
    assert len(vector) == 576
    refused = by_id["too-hot"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "temperature"
    assert by_id["too-hot"]["error"] is None
    for custom_id, why in (("other-route", "url must be one of"), ("streamed", "not streamed"), (None, "not JSON")):
        assert by_id[custom_id]["response"] is None and why in by_id[custom_id]["error"]["message"]
    assert all(o["id"].startswith("batch_req_") for o in out) and len({o["id"] for o in out}) == len(out)

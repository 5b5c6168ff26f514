"""SageMaker's /invocations answers each kind of body as its own route does, and the other
engines' names for our routes answer as ours: vLLM's /ping, /load and /reset_prefix_cache,
SGLang's /get_model_info and /get_server_info."""

from __future__ import annotations

import json

MODEL = "smollm2-135m"


def test_invocations_answers_each_body_as_its_own_route_does(smollm2_server):
    http = smollm2_server.http()
    chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0}
    completion = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    generate = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    for body, route, answer in (
        (chat, "/v1/chat/completions", lambda r: r["choices"][0]["message"]["content"]),
        (completion, "/v1/completions", lambda r: r["choices"][0]["text"]),
        ({"input": ["Paris", "Rome"]}, "/v1/embeddings", lambda r: [d["embedding"][:4] for d in r["data"]]),
        (generate, "/generate", lambda r: r["text"]),
    ):
        direct, invoked = http.post(route, json=body), http.post("/invocations", json=body)
        assert direct.status_code == invoked.status_code == 200, invoked.text
        assert answer(invoked.json()) == answer(direct.json()), route
    with http.stream("POST", "/invocations", json={**chat, "stream": True}) as stream:
        chunks = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    text = "".join(json.loads(c)["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    assert text == http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]


def test_invocations_refuses_what_no_route_answers_with_a_400(smollm2_server):
    http = smollm2_server.http()
    for body in (b"{not json", b"[1, 2]", b'{"max_tokens": 3}'):
        answer = http.post("/invocations", content=body, headers={"Content-Type": "application/json"})
        assert answer.status_code == 400 and answer.json()["error"]["message"], body
    bad = http.post("/invocations", json={"prompt": "Hi", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_the_other_engines_names_for_our_routes_answer_as_ours(smollm2_server):
    http = smollm2_server.http()
    assert http.get("/ping").status_code == http.post("/ping").status_code == 200
    assert http.get("/load").json() == {"server_load": 0}
    info = http.get("/get_model_info").json()
    assert info["served_model_name"] == MODEL and info["model_path"].endswith(".gguf") and info["is_generation"]
    assert http.get("/get_server_info").json().keys() == http.get("/server_info").json().keys()
    prompt = {"prompt": "A prompt long enough to leave something in the prefix cache.", "max_tokens": 1}
    http.post("/v1/completions", json=prompt)
    assert http.post("/v1/completions", json=prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert http.post("/reset_prefix_cache").status_code == 200
    assert http.post("/v1/completions", json=prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

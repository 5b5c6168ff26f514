"""vLLM's /tokenize and /detokenize, the completions default of 16 tokens, and chat's
`chat_template_kwargs`, against the default server (through the official openai client where
the client has the call)."""

from __future__ import annotations

import pytest

from tests.helpers import smollm2_tokenizer

MODEL = "smollm2-135m"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _assert_400(resp, param: str | None = None) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


def test_tokenize_a_prompt_gives_the_tokenizers_ids_and_detokenize_gives_the_text_back(smollm2_server):
    http = smollm2_server.http()
    tok = smollm2_tokenizer()
    text = "The capital of France is"
    out = http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert out["tokens"] == tok.encode(text) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == smollm2_server.client().models.list().data[0].max_model_len
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert plain.json()["tokens"] == tok.encode(text, add_special_tokens=False)
    assert plain.json()["token_strs"] == tok.convert_ids_to_tokens(plain.json()["tokens"])
    back = http.post("/detokenize", json={"model": MODEL, "tokens": plain.json()["tokens"]})
    assert back.json() == {"prompt": text}


def test_tokenize_messages_counts_the_prompt_a_chat_completion_gets(smollm2_server):
    http = smollm2_server.http()
    out = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    chat = smollm2_server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert out["count"] == chat.usage.prompt_tokens
    without = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert without["tokens"] == out["tokens"][: without["count"]] and without["count"] < out["count"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"prompt": "hi", "colour": "red"}, "colour"),
        ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, "messages"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_tokenize_and_detokenize_bodies_are_openai_style_400s(smollm2_server, path, body, param):
    _assert_400(smollm2_server.http().post(path, json=body), param)


def test_a_completion_without_max_tokens_stops_at_16_tokens(smollm2_server):
    res = smollm2_server.client().completions.create(
        model=MODEL, prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True}
    )
    assert res.usage.completion_tokens == 16 and res.choices[0].finish_reason == "length"


def test_chat_template_kwargs_reach_the_template(smollm2_server):
    """SmolLM2's template reads no extra variable, so the prompt is the same; the field is
    accepted (vLLM's `enable_thinking: false`), and one that would override the template call's
    own arguments is refused."""
    client = smollm2_server.client()
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    kwargs = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert kwargs.usage.prompt_tokens == plain.usage.prompt_tokens
    refused = smollm2_server.http().post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": {"add_generation_prompt": False}},
    )
    _assert_400(refused, "messages")


BEGUN = [*MESSAGES, {"role": "assistant", "content": "The capital of France is"}]
"""A conversation whose assistant reply the client has begun."""


def test_continue_final_message_prompts_inside_the_begun_reply_as_transformers_renders_it(smollm2_server):
    """The prompt ends with the final message's text, its end of turn cut off, as
    transformers' own `continue_final_message` renders it; the chat answer is what a plain
    completion of that prompt gives (greedy), so the model continued the begun reply."""
    http, client = smollm2_server.http(), smollm2_server.client()
    expected = smollm2_tokenizer().apply_chat_template(BEGUN, tokenize=False, continue_final_message=True)
    assert expected.endswith("The capital of France is")
    ids = smollm2_tokenizer().encode(expected, add_special_tokens=False)
    tokenized = http.post("/tokenize", json={"messages": BEGUN, "continue_final_message": True}).json()
    assert tokenized["tokens"] == ids
    explicit = http.post(
        "/tokenize", json={"messages": BEGUN, "continue_final_message": True, "add_generation_prompt": False}
    ).json()
    assert explicit["tokens"] == ids
    chat = client.chat.completions.create(
        model=MODEL, messages=BEGUN, max_tokens=6, temperature=0, extra_body={"continue_final_message": True}
    )
    assert chat.usage.prompt_tokens == len(ids)
    completion = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == completion.choices[0].text
    new_turn = client.chat.completions.create(model=MODEL, messages=BEGUN, max_tokens=1)
    assert new_turn.usage.prompt_tokens > len(ids)  # by default the reply is closed and a new turn begins


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (
            {"messages": BEGUN, "continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
            "add_generation_prompt",
        ),
        (
            {"messages": [*MESSAGES, {"role": "assistant", "content": " "}], "continue_final_message": True},
            "messages",
            "text to continue",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
                ]
            },
            "messages",
            "'image_url' are not supported",
        ),
    ],
)
def test_chat_prompts_that_cannot_be_rendered_as_asked_are_400s_that_say_why(smollm2_server, body, param, says):
    for path, extra in (("/v1/chat/completions", {"max_tokens": 1}), ("/tokenize", {})):
        resp = smollm2_server.http().post(path, json={**body, **extra})
        _assert_400(resp, param)
        assert says in resp.json()["error"]["message"] and "more error" not in resp.json()["error"]["message"]


def test_version_names_the_installed_package(smollm2_server):
    """GET /version, as vLLM answers it."""
    import importlib.metadata

    resp = smollm2_server.http().get("/version")
    assert resp.status_code == 200 and resp.json() == {"version": importlib.metadata.version("trident")}


def test_truncate_prompt_tokens_reads_only_the_prompts_last_tokens(smollm2_server):
    """vLLM's `truncate_prompt_tokens: k`: the prompt's last k tokens are the prompt (usage,
    echo and the greedy text say so); -1 keeps a prompt that fits whole."""
    client, http = smollm2_server.client(), smollm2_server.http()
    text = "Once upon a time, in a land far away, there lived a curious fox who loved"
    ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    greedy = {"model": MODEL, "max_tokens": 5, "temperature": 0}
    cut = client.completions.create(prompt=text, echo=True, extra_body={"truncate_prompt_tokens": 4}, **greedy)
    tail = client.completions.create(prompt=ids[-4:], echo=True, **greedy)
    assert cut.usage.prompt_tokens == 4 and cut.choices[0].text == tail.choices[0].text
    whole = client.completions.create(prompt=text, extra_body={"truncate_prompt_tokens": -1}, **greedy)
    assert whole.usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(messages=MESSAGES, extra_body={"truncate_prompt_tokens": 6}, **greedy)
    assert chat.usage.prompt_tokens == 6
    _assert_400(
        http.post("/v1/completions", json={"prompt": text, "truncate_prompt_tokens": -2}), "truncate_prompt_tokens"
    )

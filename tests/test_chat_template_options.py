"""What a chat request may tell the chat template, and how the answer begins: vLLM's
`chat_template` (only where the server trusts it) and `documents`, OpenAI's
`reasoning_effort`, vLLM's `echo`; and vLLM's `spaces_between_special_tokens`, accepted.
What the server tells it: vLLM's `--chat-template` and `--default-chat-template-kwargs`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT, Server, smollm2_tokenizer
from tokenizer_proc.responses_protocol import ResponsesRequest

MODEL = "smollm2-135m"
BEGUN = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is"},
]
"""A conversation whose assistant reply the client has begun."""
TEMPLATE = (
    "{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]\n{% endfor %}"
    "effort={{ reasoning_effort | default('unset') }}\n"
    "{% for m in messages %}{{ m.role }}> {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant>{% endif %}"
)
"""A template that shows every variable the request passes it."""


@pytest.fixture(scope="module")
def trusting_server():
    server = Server(["--dtype", "float32", "--max-total-tokens", "4096", "--trust-request-chat-template"])
    yield server
    server.stop()


def _prompt_text(server: Server, **body) -> str:
    answer = server.http().post(
        "/v1/chat/completions", json={"max_tokens": 1, "return_token_ids": True, "temperature": 0, **body}
    )
    assert answer.status_code == 200, answer.text
    return smollm2_tokenizer().decode(answer.json()["prompt_token_ids"])


def test_a_trusted_requests_template_renders_its_documents_and_reasoning_effort(trusting_server):
    messages = [{"role": "user", "content": "Where is the Eiffel tower?"}]
    documents = [{"title": "Paris", "text": "The Eiffel tower is in Paris."}, {"title": "Rome", "text": "Not here."}]
    rendered = _prompt_text(
        trusting_server, messages=messages, chat_template=TEMPLATE, documents=documents, reasoning_effort="low"
    )
    assert rendered == (
        "[Paris: The Eiffel tower is in Paris.]\n[Rome: Not here.]\neffort=low\n"
        "user> Where is the Eiffel tower?\nassistant>"
    )
    # chat_template_kwargs names the variable itself: it wins over reasoning_effort.
    kwargs = {"chat_template_kwargs": {"reasoning_effort": "high"}, "reasoning_effort": "low"}
    assert "effort=high\n" in _prompt_text(trusting_server, messages=messages, chat_template=TEMPLATE, **kwargs)
    assert _prompt_text(trusting_server, messages=messages, chat_template=TEMPLATE).startswith("effort=unset\n")
    # /tokenize renders a request's template the same way.
    tokens = (
        trusting_server.http()
        .post("/tokenize", json={"messages": messages, "chat_template": TEMPLATE, "documents": documents})
        .json()["tokens"]
    )
    assert smollm2_tokenizer().decode(tokens).startswith("[Paris: The Eiffel tower is in Paris.]")
    # Without a template of its own, the request gets the model's (which ignores documents).
    plain = _prompt_text(trusting_server, messages=messages)
    assert plain == _prompt_text(trusting_server, messages=messages, documents=documents)
    assert plain.startswith("<|im_start|>system")


def test_a_broken_request_template_is_a_400_naming_the_messages(trusting_server):
    answer = trusting_server.http().post(
        "/v1/chat/completions", json={"messages": BEGUN[:1], "chat_template": "{% for m in messages %}"}
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"


def test_a_requests_chat_template_is_a_400_on_a_server_that_does_not_trust_it(smollm2_server):
    http = smollm2_server.http()
    for route, extra in (("/v1/chat/completions", {}), ("/tokenize", {})):
        answer = http.post(route, json={"messages": BEGUN[:1], "chat_template": TEMPLATE, **extra})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in answer.json()["error"]["message"]


def test_echo_begins_the_answer_with_the_reply_the_client_began(smollm2_server):
    client = smollm2_server.client()
    kw = {"model": MODEL, "messages": BEGUN, "max_tokens": 8, "temperature": 0}
    plain = client.chat.completions.create(**kw, extra_body={"continue_final_message": True})
    echoed = client.chat.completions.create(**kw, extra_body={"continue_final_message": True, "echo": True})
    continuation = plain.choices[0].message.content
    assert continuation and echoed.choices[0].message.content == "The capital of France is" + continuation
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == (
        plain.usage.prompt_tokens,
        plain.usage.completion_tokens,
    )
    stream = client.chat.completions.create(
        **kw, stream=True, extra_body={"continue_final_message": True, "echo": True}
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == echoed.choices[0].message.content
    # A conversation that ends with the user's turn has nothing to echo.
    question = {**kw, "messages": BEGUN[:1]}
    assert (
        client.chat.completions.create(**question, extra_body={"echo": True}).choices[0].message.content
        == client.chat.completions.create(**question).choices[0].message.content
    )


def test_spaces_between_special_tokens_is_accepted_on_every_route(smollm2_server):
    http = smollm2_server.http()
    for value in (True, False):
        chat = {"messages": BEGUN[:1], "max_tokens": 2, "spaces_between_special_tokens": value}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        completion = {"prompt": "Hi", "max_tokens": 2, "spaces_between_special_tokens": value}
        assert http.post("/v1/completions", json=completion).status_code == 200
        native = {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "spaces_between_special_tokens": value}}
        assert http.post("/generate", json=native).status_code == 200


def test_the_responses_reasoning_effort_reaches_the_template_as_chats_does():
    chat = ResponsesRequest(input="Hi", reasoning={"effort": "low"}).chat_request([])
    assert chat.reasoning_effort == "low" and chat.template_variables() == {"reasoning_effort": "low"}


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("chat_template") / "template.jinja"
    path.write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def own_template_server(template_file):
    """vLLM's `--chat-template FILE` and `--default-chat-template-kwargs`."""
    flags = ["--chat-template", template_file, "--default-chat-template-kwargs", '{"reasoning_effort": "medium"}']
    server = Server(["--dtype", "float32", "--max-total-tokens", "4096", *flags])
    yield server
    server.stop()


def test_the_servers_chat_template_and_its_default_variables_render_every_chat(own_template_server):
    messages = [{"role": "user", "content": "Where is the Eiffel tower?"}]
    rendered = "effort=medium\nuser> Where is the Eiffel tower?\nassistant>"
    assert _prompt_text(own_template_server, messages=messages) == rendered
    # A request's own variables win over the server's defaults, by either name.
    kwargs = {"chat_template_kwargs": {"reasoning_effort": "high"}}
    assert _prompt_text(own_template_server, messages=messages, **kwargs).startswith("effort=high\n")
    assert _prompt_text(own_template_server, messages=messages, reasoning_effort="low").startswith("effort=low\n")
    tokens = own_template_server.http().post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert smollm2_tokenizer().decode(tokens) == rendered
    # The Anthropic route renders through the same template.
    count = own_template_server.http().post("/v1/messages/count_tokens", json={"model": MODEL, "messages": messages})
    assert count.json()["input_tokens"] == len(tokens)


def test_the_offline_engine_takes_a_template_as_text_and_default_variables():
    from trident.engine import Engine

    messages = [{"role": "user", "content": "Hi"}]
    rendered = smollm2_tokenizer().encode("effort=none\nuser> Hi\nassistant>")
    with Engine(
        dtype="float32",
        max_total_tokens=2048,
        chat_template=TEMPLATE,
        default_chat_template_kwargs={"reasoning_effort": "none"},
    ) as engine:
        out = engine.chat(messages, {"max_new_tokens": 1, "temperature": 0})
        assert out[0]["prompt_tokens"] == len(rendered)
        told = engine.chat(messages, {"max_new_tokens": 1}, chat_template_kwargs={"reasoning_effort": "much"})
        assert told[0]["prompt_tokens"] == len(smollm2_tokenizer().encode("effort=much\nuser> Hi\nassistant>"))


@pytest.mark.parametrize(
    "value, why",
    [("no/such/template.jinja", "no such file, and not a Jinja template"), ("{% for m in messages %}", "line 1")],
)
def test_the_launcher_refuses_a_chat_template_it_cannot_read_before_starting_anything(value, why):
    launch = [sys.executable, f"{REPO_ROOT}/launch.py", "--chat-template", value]
    done = subprocess.run(launch, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and why in done.stderr and "--chat-template" in done.stderr, done.stderr

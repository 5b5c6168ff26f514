"""Bad input gets a 4xx with an OpenAI-style error body and never hurts the server; overload
is a 503 with Retry-After, never a timeout; `--api-key` guards every endpoint but two."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.helpers import Server, make_random_llama

MODEL = "smollm2-135m"
CONTEXT = 8192  # SmolLM2-135M's context length
VOCAB = 49152
C = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
GEN = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}


def case(path: str, body, param: str | None, status: int = 400, *, id: str):
    return pytest.param(path, body, param, status, id=id)


BAD_INPUTS = [
    # out of range, per parameter
    case("/v1/completions", {**C, "temperature": 2.5}, "temperature", id="temperature-above-2"),
    case("/v1/completions", {**C, "temperature": -0.1}, "temperature", id="temperature-negative"),
    case("/v1/completions", {**C, "top_p": 0}, "top_p", id="top_p-zero"),
    case("/v1/completions", {**C, "top_p": 1.5}, "top_p", id="top_p-above-1"),
    case("/v1/completions", {**C, "top_k": -2}, "top_k", id="top_k-below-minus-1"),
    case("/v1/completions", {**C, "top_k": 2**40}, "top_k", id="top_k-beyond-int32"),
    case("/v1/completions", {**C, "min_p": 1.5}, "min_p", id="min_p-above-1"),
    case("/v1/completions", {**C, "min_p": -0.5}, "min_p", id="min_p-negative"),
    case("/v1/completions", {**C, "frequency_penalty": 2.5}, "frequency_penalty", id="frequency_penalty-above-2"),
    case("/v1/completions", {**C, "presence_penalty": -3}, "presence_penalty", id="presence_penalty-below-minus-2"),
    case("/v1/completions", {**C, "repetition_penalty": 0}, "repetition_penalty", id="repetition_penalty-zero"),
    case("/v1/completions", {**C, "repetition_penalty": 3}, "repetition_penalty", id="repetition_penalty-above-2"),
    case("/v1/completions", {**C, "n": 0}, "n", id="n-zero"),
    case("/v1/completions", {**C, "n": 17}, "n", id="n-above-16"),
    case("/v1/completions", {**C, "max_tokens": -5}, "max_tokens", id="max_tokens-negative"),
    case("/v1/completions", {**C, "min_tokens": -1}, "min_tokens", id="min_tokens-negative"),
    case("/v1/completions", {**C, "min_tokens": 5}, "min_tokens", id="min_tokens-above-max_tokens"),
    case("/v1/completions", {**C, "logprobs": 21}, "logprobs", id="logprobs-above-20"),
    case("/v1/completions", {**C, "logprobs": -1}, "logprobs", id="logprobs-negative"),
    case("/v1/completions", {**C, "seed": 2**64}, "seed", id="seed-beyond-int64"),
    case("/v1/completions", {**C, "stop": ["a", "b", "c", "d", "e"]}, "stop", id="stop-more-than-4"),
    case("/v1/completions", {**C, "stop": [""]}, "stop", id="stop-empty-string"),
    case("/v1/completions", {**C, "stop_token_ids": [VOCAB]}, "stop_token_ids", id="stop_token_id-outside-vocab"),
    case("/v1/completions", {**C, "stop_token_ids": [-1]}, "stop_token_ids", id="stop_token_id-negative"),
    case(
        "/v1/chat/completions",
        {**CHAT, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        id="chat-top_logprobs-above-20",
    ),
    case("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", id="chat-top_logprobs-without-logprobs"),
    case(
        "/v1/chat/completions",
        {**CHAT, "max_completion_tokens": 0},
        "max_completion_tokens",
        id="chat-max_completion_tokens-zero",
    ),
    case(
        "/generate",
        {**GEN, "sampling_params": {"temperature": 9}},
        "sampling_params",
        id="generate-temperature-above-2",
    ),
    case(
        "/generate",
        {**GEN, "sampling_params": {"max_new_tokens": -1}},
        "sampling_params",
        id="generate-max_new_tokens-negative",
    ),
    # wrong type, per parameter
    case("/v1/completions", {**C, "temperature": "hot"}, "temperature", id="temperature-string"),
    case("/v1/completions", {**C, "top_p": [1]}, "top_p", id="top_p-list"),
    case("/v1/completions", {**C, "top_k": 1.5}, "top_k", id="top_k-fraction"),
    case("/v1/completions", {**C, "min_p": "low"}, "min_p", id="min_p-string"),
    case("/v1/completions", {**C, "frequency_penalty": {}}, "frequency_penalty", id="frequency_penalty-object"),
    case("/v1/completions", {**C, "presence_penalty": "x"}, "presence_penalty", id="presence_penalty-string"),
    case("/v1/completions", {**C, "repetition_penalty": "x"}, "repetition_penalty", id="repetition_penalty-string"),
    case("/v1/completions", {**C, "n": 1.5}, "n", id="n-fraction"),
    case("/v1/completions", {**C, "max_tokens": "ten"}, "max_tokens", id="max_tokens-string"),
    case("/v1/completions", {**C, "min_tokens": "x"}, "min_tokens", id="min_tokens-string"),
    case("/v1/completions", {**C, "seed": "abc"}, "seed", id="seed-string"),
    case("/v1/completions", {**C, "stop": 5}, "stop", id="stop-number"),
    case("/v1/completions", {**C, "stop_token_ids": ["a"]}, "stop_token_ids", id="stop_token_ids-strings"),
    case("/v1/completions", {**C, "ignore_eos": "maybe"}, "ignore_eos", id="ignore_eos-string"),
    case("/v1/completions", {**C, "logprobs": "x"}, "logprobs", id="logprobs-string"),
    case("/v1/completions", {**C, "echo": "maybe"}, "echo", id="echo-string"),
    case("/v1/completions", {**C, "stream": "maybe"}, "stream", id="stream-string"),
    case(
        "/v1/completions",
        {**C, "stream_options": {"include_usage": "x"}},
        "stream_options",
        id="stream_options-include_usage-string",
    ),
    case("/v1/completions", {**C, "model": 5}, "model", id="model-number"),
    case("/v1/completions", {**C, "prompt": [1.5]}, "prompt", id="prompt-floats"),
    case("/v1/completions", {**C, "prompt": None}, "prompt", id="prompt-null"),
    case("/v1/completions", {"model": MODEL, "max_tokens": 2}, "prompt", id="prompt-missing"),
    case("/v1/completions", [1, 2], None, id="body-a-list"),
    case("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages", id="chat-messages-string"),
    case(
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
        "messages",
        id="chat-unknown-role",
    ),
    case(
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": 5}]},
        "messages",
        id="chat-content-number",
    ),
    case("/v1/chat/completions", {**CHAT, "logprobs": "x"}, "logprobs", id="chat-logprobs-string"),
    case("/generate", {**GEN, "sampling_params": "x"}, "sampling_params", id="generate-sampling_params-string"),
    case("/abort", {"rid": 5}, "rid", id="abort-rid-number"),
    # empty, over-long, over the context, outside the vocabulary
    case("/v1/completions", {**C, "prompt": ""}, "prompt", id="empty-prompt"),
    case("/v1/completions", {**C, "prompt": []}, "prompt", id="empty-token-prompt"),
    case("/v1/completions", {**C, "prompt": [""]}, "prompt", id="empty-prompt-in-list"),
    case("/v1/chat/completions", {**CHAT, "messages": []}, "messages", id="chat-no-messages"),
    case("/generate", {"text": ""}, "text", id="generate-empty-text"),
    case("/generate", {"input_ids": []}, "input_ids", id="generate-empty-input_ids"),
    case("/v1/completions", {**C, "prompt": "hello " * (CONTEXT + 100)}, "prompt", id="over-long-prompt"),
    case("/v1/completions", {**C, "prompt": [1] * (CONTEXT + 1)}, "prompt", id="over-long-token-prompt"),
    case(
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "hello " * CONTEXT}]},
        "messages",
        id="chat-over-long-prompt",
    ),
    case("/generate", {"text": "hello " * (CONTEXT + 100)}, "text", id="generate-over-long-text"),
    case("/v1/completions", {**C, "max_tokens": CONTEXT}, "max_tokens", id="prompt-plus-max_tokens-over-context"),
    case(
        "/v1/chat/completions",
        {**CHAT, "max_completion_tokens": CONTEXT},
        "max_completion_tokens",
        id="chat-prompt-plus-max_completion_tokens-over-context",
    ),
    case(
        "/generate",
        {**GEN, "sampling_params": {"max_new_tokens": CONTEXT}},
        "sampling_params.max_new_tokens",
        id="generate-prompt-plus-max_new_tokens-over-context",
    ),
    case("/v1/completions", {**C, "prompt": [5, VOCAB]}, "prompt", id="token-id-equal-to-vocab-size"),
    case("/v1/completions", {**C, "prompt": [-1, 5]}, "prompt", id="token-id-negative"),
    case("/v1/completions", {**C, "prompt": [[2**40]]}, "prompt", id="token-id-beyond-int32"),
    case("/generate", {"input_ids": [10**12]}, "input_ids", id="generate-token-id-outside-vocab"),
    case("/v1/completions", {**C, "model": "no-such-model"}, "model", 404, id="unknown-model"),
]


def assert_error_body(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if param is not None:
        assert err["param"] == param
    return err


@pytest.fixture(scope="module")
def http(smollm2_server):
    with smollm2_server.http() as client:
        yield client


@pytest.fixture(scope="module")
def pids_before(smollm2_server) -> set[int]:
    return {p.pid for p in smollm2_server.process_tree()}


def assert_no_process_restarted(server: Server, pids_before: set[int]) -> None:
    assert server.proc.poll() is None, server.log_tail()
    assert {p.pid for p in server.process_tree()} == pids_before, server.log_tail()


@pytest.mark.parametrize("path,body,param,status", BAD_INPUTS)
def test_bad_input_is_a_4xx_with_an_openai_error_body(smollm2_server, http, pids_before, path, body, param, status):
    assert_error_body(http.post(path, json=body), status, param)
    assert_no_process_restarted(smollm2_server, pids_before)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "smollm2-135m", "prompt": ',
        b"not json",
        b"\xff\xfe\x00garbage",
        b'{"prompt": "Hi",}',
    ],
    ids=["truncated", "not-json", "binary", "trailing-comma"],
)
def test_malformed_json_is_a_400_with_an_error_body(smollm2_server, http, pids_before, raw):
    err = assert_error_body(
        http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400
    )
    assert err["code"] == "json_invalid"
    assert_no_process_restarted(smollm2_server, pids_before)


@pytest.mark.parametrize("raw", [b"NaN", b"Infinity", b"-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty"])
def test_non_finite_numbers_are_rejected(smollm2_server, http, pids_before, field, raw):
    body = b'{"prompt": "Hi", "max_tokens": 2, "%s": %s}' % (field.encode(), raw)
    assert_error_body(
        http.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400, field
    )
    assert_no_process_restarted(smollm2_server, pids_before)


def test_body_over_the_size_limit_is_413_with_or_without_content_length(smollm2_server, http, pids_before):
    limit = http.get("/server_info").json()["max_request_body_bytes"]
    big = b'{"prompt": "' + b"a" * (limit + 1) + b'"}'
    err = assert_error_body(
        http.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413
    )
    assert err["code"] == "request_too_large"

    def chunked():  # no Content-Length: the server must count while it reads
        yield b'{"prompt": "'
        for _ in range(limit // (1 << 20) + 1):
            yield b"a" * (1 << 20)
        yield b'"}'

    assert_error_body(
        http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"}), 413
    )
    assert_no_process_restarted(smollm2_server, pids_before)


def test_wrong_method_and_unknown_path_have_error_bodies(http):
    assert_error_body(http.get("/v1/completions"), 405)
    assert_error_body(http.post("/v1/no-such-endpoint", json={}), 404)


def test_server_still_serves_after_all_bad_input(smollm2_server, http, pids_before):
    r = http.post("/v1/completions", json={**C, "prompt": "The capital of France is", "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    assert_no_process_restarted(smollm2_server, pids_before)
    stats = http.get("/server_info").json()["scheduler_stats"]
    assert stats["dropped_frames"] == 0


# ---------------------------------------------------------------- overload and the API key

KEY = "sk-trident-test-key"


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory):
    """Tiny random model, an API key, and room for just two open requests (one running, one queued)."""
    model = make_random_llama(str(tmp_path_factory.mktemp("tiny-llama")))
    server = Server(
        [
            "--model",
            model,
            "--api-key",
            KEY,
            "--max-running-requests",
            "1",
            "--max-queued-requests",
            "1",
            "--max-total-tokens",
            "4096",
            "--allowed-origins",
            f'["{GOOD_ORIGIN}"]',
        ]
    )
    yield server
    server.stop()


GOOD_ORIGIN = "https://app.example"


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_burst_beyond_the_queue_gets_503_with_retry_after_never_a_timeout(guarded_server):
    model = guarded_server.http().get("/v1/models", headers=auth()).json()["data"][0]["id"]
    body = {"model": model, "prompt": "Hello there", "max_tokens": 200, "ignore_eos": True}
    pids = {p.pid for p in guarded_server.process_tree()}

    def send(_: int) -> httpx.Response:
        with httpx.Client(base_url=guarded_server.base_url, timeout=60) as c:  # a timeout raises: test fails
            return c.post("/v1/completions", json=body, headers=auth())

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(send, range(8)))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(200) >= 1 and statuses.count(503) >= 1, statuses
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["Retry-After"]) >= 1
            assert assert_error_body(r, 503)["code"] == "overloaded"
        else:
            assert r.json()["usage"]["completion_tokens"] == 200
    assert {p.pid for p in guarded_server.process_tree()} == pids
    again = guarded_server.http().post("/v1/completions", json={**body, "max_tokens": 2}, headers=auth())
    assert again.status_code == 200


GUARDED_ENDPOINTS = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/anything", None),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    ("POST", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}),
    ("POST", "/abort", {"rid": "x"}),
    ("POST", "/flush_cache", None),
    ("GET", "/flush_cache", None),
    ("GET", "/server_info", None),
    ("GET", "/health_generate", None),
    ("GET", "/no-such-endpoint", None),
]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        auth("wrong-key"),
        {"Authorization": KEY},
        auth(KEY + "x"),
        {"Authorization": "Basic " + KEY},
        {"x-api-key": KEY + "x"},
    ],
    ids=["missing", "wrong", "no-bearer-scheme", "key-prefix", "basic-scheme", "wrong-x-api-key"],
)
def test_missing_or_wrong_key_is_401_on_every_guarded_endpoint(guarded_server, headers):
    with guarded_server.http() as c:
        for method, path, body in GUARDED_ENDPOINTS:
            r = c.request(method, path, json=body, headers=headers)
            assert_error_body(r, 401)
            assert r.json()["error"]["code"] == "invalid_api_key", path
            assert r.headers.get("WWW-Authenticate") == "Bearer", path


def test_health_ping_and_metrics_need_no_key(guarded_server):
    with guarded_server.http() as c:
        assert c.get("/health").status_code == 200
        assert c.get("/ping").status_code == 200 and c.post("/ping").status_code == 200
        assert c.get("/metrics").status_code == 200
        assert c.post("/invocations", json={"prompt": "Hi", "max_tokens": 1}).status_code == 401


def test_the_right_key_works_through_the_official_client_and_is_never_shown(guarded_server):
    client = guarded_server.client(api_key=KEY)
    model = client.models.list().data[0].id
    res = client.completions.create(model=model, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
    assert res.usage.completion_tokens == 3
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert chat.choices[0].message.role == "assistant"
    with pytest.raises(openai.AuthenticationError):
        guarded_server.client(api_key="wrong").models.list()
    info = guarded_server.http().get("/server_info", headers=auth())
    assert info.status_code == 200 and KEY not in info.text


def test_anthropics_client_sends_the_key_as_x_api_key_and_gets_errors_in_anthropics_shape(guarded_server):
    import anthropic

    client = anthropic.Anthropic(base_url=guarded_server.base_url, api_key=KEY, max_retries=0)
    model = guarded_server.http().get("/v1/models", headers={"x-api-key": KEY}).json()["data"][0]["id"]
    message = client.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert message.usage.output_tokens <= 2
    wrong = anthropic.Anthropic(base_url=guarded_server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.body["error"]["type"] == "authentication_error"
    assert "x-api-key" in refused.value.body["error"]["message"]


def test_a_browser_from_an_allowed_origin_passes_cors_and_the_key_still_guards(guarded_server):
    """The preflight carries no key (browsers never send one there): CORS answers it before the
    key check. The request itself still needs the key."""
    http = guarded_server.http()
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = http.options("/v1/chat/completions", headers={"Origin": GOOD_ORIGIN, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == GOOD_ORIGIN
    refused = http.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    listed = http.get("/v1/models", headers={"Origin": GOOD_ORIGIN, **auth()})
    assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == GOOD_ORIGIN
    keyless = http.get("/v1/models", headers={"Origin": GOOD_ORIGIN})
    assert keyless.status_code == 401


def test_by_default_any_origin_may_call_as_vllm_allows(smollm2_server):
    answer = smollm2_server.http().get("/v1/models", headers={"Origin": "https://any.example"})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"

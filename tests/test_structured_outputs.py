"""Structured outputs and tool calls with the real SmolLM2 and the official openai client.

Sampled at temperature 0.8 with fixed seeds, so that the constraint, not luck, is what makes
the outputs valid: the model left alone rarely writes valid JSON for these schemas. Greedy
constrained text must not depend on overlap, on what shares the batch, or on a SIGKILL of
the worker mid-generation (the resumed request re-advances its matcher over its output).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.helpers import TEST_CPU_THREADS, Server, running_server, wait_until
from tests.structured_schemas import SCHEMAS, WEATHER_TOOL
from tests.workload import child

MODEL = "smollm2-135m"
SAMPLES = 4
HOT = {"temperature": 0.8, "seed": 7, "n": SAMPLES}
EBNF = 'root ::= "The answer is " ("yes" | "no") " because " [a-z]+ "."'
REGEX = r"(red|green|blue) #[0-9a-f]{6}"
GREEDY_SCHEMA = SCHEMAS["array_of_objects"]


DEFAULT_SERVER = ["--model", MODEL, "--max-total-tokens", "16384", "--check-seq-lens"]
"""The default model as a user starts it: bf16 and batch invariant, so greedy text does not
depend on what shares the batch, on overlap or on a restart."""


@pytest.fixture(scope="module")
def default_server() -> Iterator[Server]:
    with running_server(DEFAULT_SERVER) as server:
        yield server


@pytest.fixture(scope="module")
def default_plain_loop_server() -> Iterator[Server]:
    """Overlap off; the SIGKILL tests restart its processes, so it is kept apart."""
    with running_server([*DEFAULT_SERVER, "--disable-overlap"]) as server:
        yield server


def chat(server: Server, prompt: str, **kw):
    return server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=kw.pop("max_tokens", 160), **kw
    )


def json_schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_always_parse_and_validate(default_server, name):
    schema = SCHEMAS[name]
    res = chat(default_server, "Reply with a JSON example.", response_format=json_schema_format(schema), **HOT)
    assert len(res.choices) == SAMPLES
    for choice in res.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_schema_not_strict_still_validates(default_server):
    schema = SCHEMAS["nested_object"]
    res = chat(default_server, "A person as JSON.", response_format=json_schema_format(schema, strict=False), **HOT)
    for choice in res.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_always_gives_a_json_object(default_server):
    res = default_server.client().completions.create(
        model=MODEL, prompt="Some data:", max_tokens=120, extra_body={"response_format": {"type": "json_object"}}, **HOT
    )
    for choice in res.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
        else:  # out of tokens inside a long string: still the start of one object
            assert choice.text.startswith("{")


@pytest.mark.parametrize("field,holds", [("regex", lambda t: re.fullmatch(REGEX, t)), ("ebnf", None)])
def test_regex_and_ebnf_hold_on_generate(default_server, field, holds):
    http = default_server.http()
    spec = REGEX if field == "regex" else EBNF
    for seed in range(SAMPLES):
        params = {field: spec, "temperature": 0.8, "seed": seed, "max_new_tokens": 60}
        r = http.post("/generate", json={"text": "Answer:", "sampling_params": params})
        assert r.status_code == 200, r.text
        text = r.json()["text"]
        if field == "regex":
            assert holds(text), text
        elif r.json()["meta_info"]["finish_reason"] == "length":  # [a-z]+ may run to the token limit
            assert re.fullmatch(r"The answer is (yes|no) because [a-z]*", text), text
        else:
            assert re.fullmatch(r"The answer is (yes|no) because [a-z]+\.", text), text


CHOICES = ["positive", "negative", 'says "hi"\n']
"""vLLM's `choice`, one with a quote and a newline that the grammar must escape."""


@pytest.mark.parametrize(
    ("outputs", "holds"),
    [
        ({"choice": CHOICES}, lambda t: t in CHOICES),
        ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
        ({"json": GREEDY_SCHEMA}, lambda t: jsonschema.validate(json.loads(t), GREEDY_SCHEMA) is None),
        (
            {"grammar": 'root ::= "The answer is " ("yes" | "no") "."'},
            lambda t: re.fullmatch(r"The answer is (yes|no)\.", t),
        ),
    ],
    ids=["choice", "regex", "json", "grammar"],
)
def test_vllm_structured_outputs_constrain_chat_and_completions(default_server, outputs, holds):
    """vLLM's `structured_outputs` (since v0.12, for its removed guided_* fields) holds on
    both OpenAI routes, each sample finished by the constraint, not by the token limit."""
    extra = {"extra_body": {"structured_outputs": outputs}}
    res = chat(default_server, "Classify: trident is wonderful!", **HOT, **extra)
    completion = default_server.client().completions.create(
        model=MODEL, prompt="Answer:", max_tokens=160, **HOT, **extra
    )
    for text, finish in [(c.message.content, c.finish_reason) for c in res.choices] + [
        (c.text, c.finish_reason) for c in completion.choices
    ]:
        assert finish == "stop" and holds(text), text


@pytest.mark.parametrize(
    ("field", "value", "holds"),
    [
        ("guided_choice", CHOICES, lambda t: t in CHOICES),
        ("guided_regex", REGEX, lambda t: re.fullmatch(REGEX, t)),
        ("guided_json", GREEDY_SCHEMA, lambda t: jsonschema.validate(json.loads(t), GREEDY_SCHEMA) is None),
    ],
    ids=["choice", "regex", "json"],
)
def test_vllms_older_guided_fields_constrain_as_structured_outputs_does(default_server, field, value, holds):
    """vLLM's names before v0.12, which clients and tutorials still send (with a backend name,
    which changes nothing here)."""
    extra = {"extra_body": {field: value, "guided_decoding_backend": "xgrammar"}}
    completion = default_server.client().completions.create(
        model=MODEL, prompt="Answer:", max_tokens=160, **HOT, **extra
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop" and holds(choice.text), choice.text


def _check_weather_call(call) -> None:
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER_TOOL["function"]["parameters"])


NAMED = {"type": "function", "function": {"name": "get_weather"}}
OTHER_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_calls_give_valid_arguments(default_server, tool_choice):
    res = chat(default_server, "What is the weather in Oslo?", tools=[WEATHER_TOOL], tool_choice=tool_choice, **HOT)
    for choice in res.choices:  # `required` allows parallel calls
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            _check_weather_call(call)


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_calls_stream_as_tool_call_deltas(default_server, tool_choice):
    stream = chat(
        default_server,
        "What is the weather in Oslo?",
        tools=[WEATHER_TOOL, OTHER_TOOL] if tool_choice == NAMED else [WEATHER_TOOL],
        tool_choice=tool_choice,
        stream=True,
        temperature=0.8,
        seed=3,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and len(calls) >= 1 and (tool_choice == "required" or len(calls) == 1)
    for call in calls.values():
        assert call["name"] == "get_weather" and call["id"]
        jsonschema.validate(json.loads(call["arguments"]), WEATHER_TOOL["function"]["parameters"])


def test_auto_tool_choice_answers_text_or_a_well_formed_call(default_server):
    res = chat(default_server, "What is the weather in Oslo?", tools=[WEATHER_TOOL], tool_choice="auto", **HOT)
    for choice in res.choices:
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                assert call.function.name == "get_weather"
                assert isinstance(json.loads(call.function.arguments), dict)
        else:
            assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")


def test_logit_bias_moves_the_greedy_token(default_server):
    http = default_server.http()

    def first_token(bias: dict[str, float]) -> int:
        params = {"max_new_tokens": 1, "temperature": 0, "logit_bias": bias}
        r = http.post("/generate", json={"text": "The capital of France is", "sampling_params": params})
        assert r.status_code == 200, r.text
        return r.json()["output_ids"][0]

    top = first_token({})
    assert first_token({str(top): -100}) != top
    pushed = 47  # '?' in SmolLM2's vocabulary: not the natural next token here
    assert pushed != top and first_token({str(pushed): 100}) == pushed
    res = default_server.client().completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0, logit_bias={str(pushed): 100}
    )
    assert res.choices[0].text == "?"


BAD_REQUESTS = [
    ("/generate", {"text": "Hi", "temprature": 0}, "temprature"),
    ("/generate", {"text": "Hi", "sampling_params": {"temprature": 0}}, "sampling_params.temprature"),
    ("/v1/completions", {"prompt": "Hi", "temprature": 0}, "temprature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "temprature": 0}, "temprature"),
    ("/generate", {"text": "Hi", "sampling_params": {"regex": "(a|b"}}, "regex"),
    ("/generate", {"text": "Hi", "sampling_params": {"ebnf": "root ::= undefined_rule"}}, "ebnf"),
    ("/generate", {"text": "Hi", "sampling_params": {"json_schema": '{"type": "nope"}'}}, "json_schema"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "response_format": json_schema_format({"type": "nope"})},
        "response_format.json_schema.schema",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "yaml"}},
        "response_format",
    ),
    (
        "/v1/completions",
        {"prompt": "Hi", "response_format": {"type": "json_object"}, "regex": "a"},
        "regex/ebnf/json_schema",
    ),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"49152": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "structured_outputs": {}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"choice": []}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"regex": "(a|b"}}, "structured_outputs.regex"),
    (
        "/v1/completions",
        {"prompt": "Hi", "structured_outputs": {"grammar": "root ::= x"}},
        "structured_outputs.grammar",
    ),
    (
        "/v1/completions",
        {"prompt": "Hi", "structured_outputs": {"choice": ["a"], "json_object": True}},
        "structured_outputs.json_object",
    ),
    (
        "/v1/completions",
        {"prompt": "Hi", "structured_outputs": {"structural_tag": "{}"}},
        "structured_outputs.structural_tag",
    ),
    ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"regex": "a"}, "regex": "b"}, "structured_outputs"),
    ("/v1/completions", {"prompt": "Hi", "guided_regex": "(a|b"}, "guided_regex"),
    ("/v1/completions", {"prompt": "Hi", "guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"prompt": "Hi", "guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ("/v1/completions", {"prompt": "Hi", "guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "guided_*"),
    ("/v1/completions", {"prompt": "Hi", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
]


def test_unknown_fields_and_bad_constraints_get_400_and_restart_nothing(default_server):
    pids = {p.pid for p in default_server.process_tree()}
    http = default_server.http()
    for path, body, param in BAD_REQUESTS:
        r = http.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        error = r.json()["error"]
        assert error["param"] == param, error
        assert error["type"] == "invalid_request_error" and error["message"]
    with pytest.raises(openai.BadRequestError, match="temprature"):
        default_server.client().completions.create(model=MODEL, prompt="Hi", extra_body={"temprature": 0})
    assert {p.pid for p in default_server.process_tree()} == pids


def test_openai_no_op_fields_are_accepted(default_server):
    res = chat(
        default_server,
        "Hi",
        max_tokens=2,
        user="u1",
        store=False,
        metadata={"k": "v"},
        parallel_tool_calls=True,
        tools=[WEATHER_TOOL],
        tool_choice="none",
    )
    assert res.choices[0].message.content is not None


def _greedy_constrained(server: Server, prompt: str) -> str:
    res = chat(server, prompt, response_format=json_schema_format(GREEDY_SCHEMA), temperature=0, max_tokens=120)
    return res.choices[0].message.content


def _greedy_plain(server: Server, prompt: str) -> str:
    return chat(server, prompt, temperature=0, max_tokens=40).choices[0].message.content


PROMPTS = [f"List team member number {i} as JSON." for i in range(6)]


def test_constrained_and_unconstrained_rows_batched_together(default_server):
    alone = [_greedy_constrained(default_server, PROMPTS[0]), _greedy_plain(default_server, PROMPTS[1])]
    with ThreadPoolExecutor(8) as pool:
        constrained = [pool.submit(_greedy_constrained, default_server, p) for p in PROMPTS]
        plain = [pool.submit(_greedy_plain, default_server, p) for p in PROMPTS]
        constrained, plain = [f.result() for f in constrained], [f.result() for f in plain]
    for text in constrained:
        jsonschema.validate(json.loads(text), GREEDY_SCHEMA)
    assert constrained[0] == alone[0] and plain[1] == alone[1]


def test_overlap_on_and_off_give_the_same_constrained_greedy_text(default_server, default_plain_loop_server):
    for prompt in PROMPTS[:3]:
        assert _greedy_constrained(default_server, prompt) == _greedy_constrained(default_plain_loop_server, prompt)


KILL_AFTER_CHUNKS = 3
"""The victim dies as the stream's third content chunk reaches the client: generation is
under way, and the rest of the JSON (28 of its 31 chunks) is still to come. Killing on a /metrics
poll instead raced the request's end on a loaded CI host."""


@pytest.mark.parametrize("victim", ["trident::worker[tp0]", "trident::scheduler"], ids=["worker", "scheduler"])
def test_constrained_request_survives_a_sigkill_with_the_same_text(default_server, default_plain_loop_server, victim):
    prompt = PROMPTS[4]
    expected = _greedy_constrained(default_server, prompt)
    server = default_plain_loop_server
    before = {p.pid for p in server.process_tree()}
    process = child(server, victim)
    stream = chat(
        server, prompt, response_format=json_schema_format(GREEDY_SCHEMA), temperature=0, max_tokens=120, stream=True
    )
    pieces: list[str] = []
    chunks_after_kill = 0
    for chunk in stream:
        content = chunk.choices[0].delta.content if chunk.choices else None
        if not content:
            continue
        pieces.append(content)
        if len(pieces) == KILL_AFTER_CHUNKS:
            process.kill()
        elif len(pieces) > KILL_AFTER_CHUNKS:
            chunks_after_kill += 1
    assert chunks_after_kill > 0  # the kill landed mid-generation
    assert {p.pid for p in server.process_tree()} != before
    assert wait_until(lambda: _resumed_requests(server) >= 1, timeout=10)
    text = "".join(pieces)
    jsonschema.validate(json.loads(text), GREEDY_SCHEMA)
    assert text == expected


def _resumed_requests(server: Server) -> int:
    """Requests put back after a lost worker (the scheduler's count) or scheduler (the tokenizer's)."""
    stats = server.http().get("/server_info").json()["scheduler_stats"] or {}
    return stats.get("resumed_requests", 0) + int(server.counter("trident_resumed_requests_total"))


def test_offline_engine_takes_the_same_constraints():
    from trident.engine import Engine

    with Engine(max_total_tokens=8192, cpu_threads=TEST_CPU_THREADS) as engine:
        hot = {"temperature": 0.8, "seed": 1, "max_new_tokens": 120}
        regex, schema = engine.generate(
            ["Answer:", "A team as JSON:"],
            [{**hot, "regex": REGEX}, {**hot, "json_schema": json.dumps(GREEDY_SCHEMA)}],
        )
        with pytest.raises(ValueError, match="parenthesis"):
            engine.generate("Answer:", {"regex": "(a|b"})
    assert re.fullmatch(REGEX, regex["text"]), regex["text"]
    jsonschema.validate(json.loads(schema["text"]), GREEDY_SCHEMA)


def test_constrained_and_biased_rows_never_draft():
    """Drafts are verified against the raw argmax, so rows under a mask or a bias do not draft."""
    from trident.wire.frontend import GrammarSpec, SamplingParams

    assert SamplingParams(max_new_tokens=8, temperature=0.0).drafts_allowed()
    assert not SamplingParams(max_new_tokens=8, temperature=0.0, grammar=GrammarSpec("regex", "a+")).drafts_allowed()
    assert not SamplingParams(max_new_tokens=8, temperature=0.0, logit_bias=[(5, 1.0)]).drafts_allowed()

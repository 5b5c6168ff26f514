"""/v1/embeddings through the official openai client: each input's final hidden state,
pooled (last token, or mean over a chunked prompt) and L2-normalized, equals transformers'
float32 model on the same weights; embedding rows share batches with generation without
changing its greedy text."""

from __future__ import annotations

import base64
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np
import openai
import pytest
import torch

from gpu_worker.runtime.batch_state import PooledChunk, StepPlan
from gpu_worker.runtime.pooling import Pooler, PoolingOutOfStep
from tests.helpers import Server, running_server, wait_until, write_sim_profile
from tests.test_simulated_worker import sim_args
from trident.wire.backend import Embeddings
from trident.wire.codec import FrameEncoder, pack_int32
from trident.wire.frontend import EmbedReq

MODEL = "smollm2-135m"
TEXTS = [
    "The capital of France is Paris.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his three daughters.",
    "Hi",
]
TOLERANCE = 2e-4
"""Largest difference of a coordinate of a unit vector from the reference's (float32 on
both sides: the server's kernels sum in another order)."""


def reference_vectors(hf_reference, ids: list[list[int]], pooling: str) -> list[np.ndarray]:
    _, model = hf_reference
    out = []
    for row in ids:
        with torch.no_grad():
            states = model.model(torch.tensor([row])).last_hidden_state[0]  # after the final norm
        pooled = states[-1] if pooling == "last" else states.mean(0)
        out.append(torch.nn.functional.normalize(pooled, dim=0).numpy())
    return out


def assert_close(got: list[float] | np.ndarray, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape
    assert abs(float(np.linalg.norm(got)) - 1.0) < 1e-5
    assert float(np.abs(got - want).max()) < TOLERANCE, float(np.abs(got - want).max())


def token_ids(hf_reference, texts: list[str]) -> list[list[int]]:
    tok, _ = hf_reference
    return [tok(t).input_ids for t in texts]


# ---- the parts, without a server ------------------------------------------------------


def test_embedding_frames_are_plain_msgpack_and_vectors_must_split_into_rows():
    frame = FrameEncoder().encode(EmbedReq("e1", pack_int32([1, 2, 3])))
    decoded = msgpack.unpackb(frame, raw=False)
    assert decoded[:2] == ["embed", "e1"] and np.frombuffer(decoded[2], "<i4").tolist() == [1, 2, 3]
    vectors = np.arange(6, dtype="<f4")
    emb = Embeddings(3, vectors.tobytes())
    assert emb.rows == 2 and np.frombuffer(emb.row(1), "<f4").tolist() == [3.0, 4.0, 5.0]
    with pytest.raises(ValueError):
        Embeddings(4, vectors.tobytes())


def plan_of(chunks: list[PooledChunk]) -> StepPlan:
    empty = np.zeros(0, dtype=np.int64)
    return StepPlan([], [], {}, empty, empty, [], 0, empty, [], [], [], chunks, [])


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_pooler_over_chunks_equals_pooling_the_whole_prompt(mode):
    states = torch.randn(10, 8)
    pooler = Pooler(mode, 8, max_slots=4, device=torch.device("cpu"))
    # Slot 2's prompt of 10 tokens in chunks of 4, 4, 2; slot 1's of 3 tokens in one, beside it.
    other = torch.randn(3, 8)
    steps = [
        [PooledChunk(0, 4, 0, 2, False)],
        [PooledChunk(0, 3, 0, 1, True), PooledChunk(3, 4, 4, 2, False)],
        [PooledChunk(0, 2, 8, 2, True)],
    ]
    flat = [states[0:4], torch.cat([other, states[4:8]]), states[8:10]]
    taken = []
    for chunks, step_states in zip(steps, flat):
        plan = plan_of(chunks)
        pooler.pool(plan, step_states[torch.from_numpy(pooler.positions(plan))])
        emb = pooler.take()
        taken.append(None if emb is None else np.frombuffer(emb.vectors, "<f4").reshape(emb.rows, 8))
    assert taken[0] is None
    pool = (lambda s: s[-1]) if mode == "last" else (lambda s: s.mean(0))
    want_other = torch.nn.functional.normalize(pool(other), dim=0).numpy()
    want_long = torch.nn.functional.normalize(pool(states), dim=0).numpy()
    np.testing.assert_allclose(taken[1][0], want_other, atol=1e-6)
    np.testing.assert_allclose(taken[2][0], want_long, atol=1e-6)


def test_mean_pooling_refuses_a_chunk_that_skips_tokens():
    pooler = Pooler("mean", 4, max_slots=2, device=torch.device("cpu"))
    pooler.pool(plan_of([PooledChunk(0, 3, 0, 0, False)]), torch.ones(3, 4))
    with pytest.raises(PoolingOutOfStep):
        pooler.pool(plan_of([PooledChunk(0, 2, 5, 0, True)]), torch.ones(2, 4))


# ---- last-token pooling: the default server --------------------------------------------


def test_batch_of_texts_equals_transformers_last_token_states(smollm2_server, hf_reference):
    client = smollm2_server.client()
    res = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    ids = token_ids(hf_reference, TEXTS)
    assert [d.index for d in res.data] == list(range(len(TEXTS)))
    assert res.model == MODEL and res.object == "list"
    assert res.usage.prompt_tokens == res.usage.total_tokens == sum(map(len, ids))
    for got, want in zip(res.data, reference_vectors(hf_reference, ids, "last")):
        assert_close(got.embedding, want)


def test_float_and_base64_encodings_carry_the_same_float32_vector(smollm2_server):
    http = smollm2_server.http()
    body = {"model": MODEL, "input": TEXTS[0]}
    as_floats = http.post("/v1/embeddings", json=body | {"encoding_format": "float"}).json()
    as_base64 = http.post("/v1/embeddings", json=body | {"encoding_format": "base64"}).json()
    floats = np.asarray(as_floats["data"][0]["embedding"], dtype=np.float32)
    decoded = np.frombuffer(base64.b64decode(as_base64["data"][0]["embedding"]), dtype="<f4")
    assert len(floats) == 576 and float(np.abs(floats - decoded).max()) < 1e-6
    client_floats = smollm2_server.client().embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert float(np.abs(np.asarray(client_floats.data[0].embedding) - decoded).max()) < 1e-6


def test_token_id_inputs_equal_their_text(smollm2_server, hf_reference):
    client = smollm2_server.client()
    ids = token_ids(hf_reference, TEXTS[:2])
    one = client.embeddings.create(model=MODEL, input=ids[0])
    many = client.embeddings.create(model=MODEL, input=ids)
    want = reference_vectors(hf_reference, ids, "last")
    assert len(one.data) == 1 and len(many.data) == 2 and one.usage.prompt_tokens == len(ids[0])
    assert_close(one.data[0].embedding, want[0])
    for got, w in zip(many.data, want):
        assert_close(got.embedding, w)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"input": "hello", "dimensions": 64}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": [1] * 10_000}, "input"),
        ({"input": [1.5, 2.5]}, "input"),
        ({"input": "hello", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_requests_are_400_with_an_openai_error(smollm2_server, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        smollm2_server.client().embeddings.create(model=MODEL, **extra)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


def test_unknown_model_is_404(smollm2_server):
    with pytest.raises(openai.NotFoundError):
        smollm2_server.client().embeddings.create(model="no-such-model", input="hi")


# ---- mean pooling over chunked prompts, beside generation ------------------------------


@pytest.fixture(scope="module")
def mean_server():
    """Prompts run in chunks of 8 tokens, so that most inputs are pooled over several steps."""
    server = Server(
        ["--dtype", "float32", "--max-total-tokens", "8192", "--check-seq-lens"]
        + ["--pooling", "mean", "--chunked-prefill-size", "8"]
    )
    yield server
    server.stop()


def test_mean_over_chunked_prompts_equals_transformers(mean_server, hf_reference):
    res = mean_server.client().embeddings.create(model=MODEL, input=TEXTS)
    for got, want in zip(res.data, reference_vectors(hf_reference, token_ids(hf_reference, TEXTS), "mean")):
        assert_close(got.embedding, want)


def test_embeddings_beside_a_generation_leave_its_greedy_text_unchanged(mean_server, hf_reference):
    client = mean_server.client()
    prompt = "Once upon a time, in a small village,"

    def generate() -> str:
        res = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0)
        return res.choices[0].text

    alone = generate()
    want = reference_vectors(hf_reference, token_ids(hf_reference, TEXTS), "mean")
    with ThreadPoolExecutor(4) as pool:
        text = pool.submit(generate)
        embedded = [pool.submit(client.embeddings.create, model=MODEL, input=TEXTS) for _ in range(3)]
        assert text.result() == alone
        for res in embedded:
            for got, w in zip(res.result().data, want):
                assert_close(got.embedding, w)


# ---- a worker lost mid-request ---------------------------------------------------------


def pid_of(server: Server, title: str) -> int:
    [pid] = [p.pid for p in server.process_tree() if " ".join(p.cmdline()).strip() == title]
    return pid


@pytest.mark.parametrize("killed_title", ["trident::worker[tp0]", "trident::scheduler"])
def test_an_embedding_in_flight_when_a_process_is_killed_is_resumed(tmp_path, killed_title):
    # 4 s a step (simulated worker): the kill lands while the step that pools the input is on
    # the worker, when (with overlap) no row of the batch holds the request any more. A lost
    # worker: the scheduler requeues it from the lost step. A lost scheduler: the tokenizer
    # resubmits it to the successor. Either way the client gets the same vector.
    profile = write_sim_profile(str(tmp_path / "profile.json"), const_s=4.0)
    with running_server(sim_args(profile, "--pooling", "mean")) as server:
        client = server.client(timeout=60)
        expected = client.embeddings.create(model=MODEL, input="The sea").data[0].embedding
        killed = pid_of(server, killed_title)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(lambda: client.embeddings.create(model=MODEL, input="The sea").data[0].embedding)
            assert wait_until(lambda: server.http().get("/server_info").json()["tokenizer_stats"]["open_requests"], 10)
            time.sleep(1.0)  # the scheduler admits it at once; its step runs 4 s
            os.kill(killed, signal.SIGKILL)
            assert pending.result(timeout=90) == expected
        assert pid_of(server, killed_title) != killed

"""OpenAI's /v1/embeddings: each input's pooled final hidden state, L2-normalized.

An input is a string, or token ids; a request holds one or a list of them. Each becomes
one `EmbedReq`, which the scheduler batches with everything else as a prefill that samples
nothing; the worker pools its final hidden states (`--pooling last|mean`,
gpu_worker/runtime/pooling.py). The answer is OpenAI's, with the vector as a list of floats
or, for `encoding_format: "base64"` (what the official client asks for by default), as the
base64 of its little-endian float32 bytes.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

import msgspec
import numpy as np
from fastapi import APIRouter, Request, Response

from tokenizer_proc.errors import SERVER_ERROR, APIError
from tokenizer_proc.protocol import EmbeddingRequest
from tokenizer_proc.sampling import ModelLimits, check_model, check_prompt_ids
from tokenizer_proc.serving import CLIENT_CLOSED, ClientDisconnected, collect
from tokenizer_proc.state import FrontendState, get_state
from tokenizer_proc.tokenization import encode_text

router = APIRouter()

MAX_INPUTS = 2048
"""Inputs per request, OpenAI's limit."""
_JSON = msgspec.json.Encoder()


def tokenized_inputs(st: FrontendState, given: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    """The token ids of every input, each checked against the model (a 400 if empty, out of
    the vocabulary, or longer than the context)."""
    if isinstance(given, str):
        given = [given]
    if not given:
        raise APIError("input is empty: give a string, a list of strings, or token ids.", param="input")
    if isinstance(given[0], int):
        given = [given]  # type: ignore[list-item]
    if len(given) > MAX_INPUTS:
        raise APIError(f"input has {len(given)} items; at most {MAX_INPUTS} are allowed.", param="input")
    inputs = []
    for i, item in enumerate(given):
        if isinstance(item, str):
            if not item:
                raise APIError(f"input[{i}] is an empty string.", param="input", code="empty_prompt")
            item = encode_text(st.tokenizer, item)
        check_prompt_ids(item, st.limits, "input")
        check_fits_context(len(item), st.limits, i)
        inputs.append(list(item))
    return inputs


def check_fits_context(length: int, limits: ModelLimits, index: int) -> None:
    if length > limits.context_length:
        raise APIError(
            f"This model's maximum context length is {limits.context_length} tokens, but input[{index}] "
            f"has {length} tokens.",
            param="input",
            code="context_length_exceeded",
        )


def embedding_item(index: int, vector: bytes, encoding_format: str) -> dict[str, Any]:
    """One `data` entry; `vector` is little-endian float32, as the base64 form sends it."""
    if encoding_format == "base64":
        encoded: Any = base64.b64encode(vector).decode("ascii")
    else:
        encoded = np.frombuffer(vector, dtype="<f4").tolist()
    return {"object": "embedding", "index": index, "embedding": encoded}


@router.post("/v1/embeddings", response_model=None)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    st = get_state(request)
    check_model(body.model, st.limits)
    if body.dimensions is not None:
        raise APIError(
            f"dimensions is not supported: {st.args.served_model_name} was not trained to give shortened "
            "embeddings (Matryoshka representation learning), so a cut vector would not be a meaningful "
            "embedding; leave dimensions out for the full vector.",
            param="dimensions",
            code="unsupported_parameter",
        )
    inputs = tokenized_inputs(st, body.input)
    eid = f"embd-{uuid.uuid4().hex}"
    handles = await st.manager.submit_embeddings(inputs, [f"{eid}-{i}" for i in range(len(inputs))])
    try:
        results = await collect(request, handles)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    for r in results:  # an error raised already; an abort (/abort, shutdown) has no vector
        if not r.embedding:
            raise APIError(f"input[{r.index}] ended ({r.finish_reason}) without its embedding", 503, type_=SERVER_ERROR)
    prompt_tokens = sum(len(ids) for ids in inputs)
    return Response(
        _JSON.encode(
            {
                "object": "list",
                "data": [embedding_item(r.index, r.embedding, body.encoding_format) for r in results],
                "model": st.args.served_model_name,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            }
        ),
        media_type="application/json",
    )

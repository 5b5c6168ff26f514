"""Amazon SageMaker's two routes, as vLLM serves them: GET/POST /ping (health) and POST
/invocations, which answers a body by what it holds: `messages` a chat completion, `prompt`
a completion, `input` embeddings, `text` or `input_ids` SGLang's /generate. A SageMaker
endpoint sends every request to /invocations, so one deployment serves all of them."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ValidationError

from tokenizer_proc.chat_protocol import ChatCompletionRequest
from tokenizer_proc.embeddings_api import create_embeddings
from tokenizer_proc.errors import APIError, validation_api_error
from tokenizer_proc.native_api import generate
from tokenizer_proc.openai_api import create_chat_completion, create_completion
from tokenizer_proc.protocol import CompletionRequest, EmbeddingRequest, GenerateRequest

router = APIRouter()

_ROUTES: list[tuple[tuple[str, ...], type[BaseModel], Callable[[Any, Request], Awaitable[Response]]]] = [
    (("messages",), ChatCompletionRequest, create_chat_completion),
    (("prompt",), CompletionRequest, create_completion),
    (("input",), EmbeddingRequest, create_embeddings),
    (("text", "input_ids"), GenerateRequest, generate),
]
"""Which route answers a body holding which field, in the order they are looked for."""


@router.post("/invocations", response_model=None)
async def invocations(request: Request) -> Response:
    try:
        body = json.loads(await request.body())
    except json.JSONDecodeError as e:
        raise APIError(f"malformed JSON body: {e}", code="json_invalid") from e
    if not isinstance(body, dict):
        raise APIError("The body must be a JSON object.")
    for fields, model, route in _ROUTES:
        if any(f in body for f in fields):
            try:
                parsed = model.model_validate(body)
            except ValidationError as e:
                raise validation_api_error(e.errors()) from e
            return await route(parsed, request)
    raise APIError(
        "/invocations answers a body with `messages` (chat), `prompt` (completion), `input` (embeddings) "
        "or `text`/`input_ids` (/generate); this one has none of them."
    )

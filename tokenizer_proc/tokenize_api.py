"""vLLM's /tokenize and /detokenize: the served model's tokenizer, without generating.

/tokenize takes a raw prompt (`prompt`, encoded as /v1/completions encodes it) or a
conversation (`messages`, rendered by the chat template as /v1/chat/completions renders
it); the body's shape says which. It answers `{"tokens", "count", "max_model_len"}`, plus
`token_strs` when asked. /detokenize takes `{"tokens"}` and answers `{"prompt"}`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from tokenizer_proc.chat_protocol import TokenizeChatRequest
from tokenizer_proc.openai_request import render_chat
from tokenizer_proc.protocol import DetokenizeRequest, TokenizeCompletionRequest
from tokenizer_proc.sampling import check_model, check_prompt_ids
from tokenizer_proc.state import get_state
from tokenizer_proc.tools import ToolPlan

router = APIRouter()


def tokenize_request(raw: dict[str, Any]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The body as the one of vLLM's two shapes it has (`messages` marks a chat)."""
    model = TokenizeChatRequest if "messages" in raw else TokenizeCompletionRequest
    try:
        return model.model_validate(raw)
    except ValidationError as e:  # shaped into a 400 like any body FastAPI validates
        raise RequestValidationError(e.errors()) from e


@router.post("/tokenize")
async def tokenize(request: Request, raw: dict[str, Any] = Body(...)) -> dict[str, Any]:
    st = get_state(request)
    body = tokenize_request(raw)
    check_model(body.model, st.limits)
    if isinstance(body, TokenizeChatRequest):
        _, tokens = render_chat(st, body, ToolPlan([], "none"))
    else:
        tokens = list(st.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    out: dict[str, Any] = {"count": len(tokens), "max_model_len": st.limits.context_length, "tokens": tokens}
    if body.return_token_strs:
        out["token_strs"] = st.tokenizer.convert_ids_to_tokens(tokens)
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    st = get_state(request)
    check_model(body.model, st.limits)
    if body.tokens:  # no tokens is the empty text, as vLLM answers
        check_prompt_ids(body.tokens, st.limits, "tokens")
    return {"prompt": st.tokenizer.decode(body.tokens)}

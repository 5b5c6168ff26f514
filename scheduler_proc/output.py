"""Turning a step's sampled tokens into request progress and TokenOut messages."""

from __future__ import annotations

from scheduler_proc.request import FinishReason, Req
from wire.backend import RowLogprobs
from wire.frontend import TokenOut


def append_token(req: Req, token: int, eos_ids: frozenset[int], context_length: int) -> None:
    """Adds one sampled token and decides whether the request is done."""
    req.output_ids.append(token)
    sp = req.sampling
    n = len(req.output_ids)
    if n >= sp.min_new_tokens and (token in sp.stop_token_ids or (not sp.ignore_eos and token in eos_ids)):
        req.finish(FinishReason.STOP)
    elif n >= sp.max_new_tokens or len(req.prompt_ids) + n >= context_length:
        req.finish(FinishReason.LENGTH)


def token_out(req: Req, logprobs: list[RowLogprobs]) -> TokenOut:
    """The tokens of req not yet sent, with its finish state; marks them sent."""
    new = req.output_ids[req.sent_output_len :]
    req.sent_output_len = len(req.output_ids)
    return TokenOut(
        rid=req.rid,
        token_ids=new,
        finish_reason=req.finish_reason.value if req.finish_reason else None,
        prompt_tokens=len(req.prompt_ids),
        cached_tokens=req.cached_tokens,
        error=req.error,
        token_logprobs=[lp.token_logprob for lp in logprobs] if logprobs else [],
        top_logprobs=[lp.top for lp in logprobs] if logprobs else [],
    )

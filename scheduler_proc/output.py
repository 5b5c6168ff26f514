"""A step's sampled tokens: into each request's progress, and out as one TokenOutBatch.

This is the per-row hot path of a decode step (every running request, every step), so the
common case (one token per row, no logprobs) does the least Python per row: append the
token, and look closer only if it may end the request or it is the request's first one.
The tokenizer gets the step column-wise (wire/frontend.py `TokenOutBatch`): the worker's
token bytes are passed through when no row was dropped, and only rows with something
unusual (a finish, cached tokens, logprobs) carry a `RowExtras`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from scheduler_proc.request import FinishReason, Req
from trident.wire.backend import RowLogprobs, StepResult
from trident.wire.codec import pack_int32, unpack_int32
from trident.wire.frontend import RowExtras, TokenOutBatch


def append_token(req: Req, token: int) -> None:
    """Adds one sampled token and decides whether the request is done."""
    out = req.output_ids
    out.append(token)
    if token in req.stop_ids and len(req.resumed_ids) + len(out) >= req.sampling.min_new_tokens:
        req.finish(FinishReason.STOP)
    elif len(out) >= req.max_output_len:
        req.finish(FinishReason.LENGTH)


def row_extras(row: int, req: Req, logprobs: RowLogprobs | None = None) -> RowExtras | None:
    """What row `row` (request `req`, its tokens just appended) needs beyond its tokens."""
    first = len(req.output_ids) <= 1
    cached = req.cached_tokens if first else 0
    ended_early = req.finish_reason in (FinishReason.ABORT, FinishReason.ERROR)
    prompt_logprobs = req.take_prompt_logprobs() if first and not ended_early else None
    if req.finish_reason is None and not cached and logprobs is None and prompt_logprobs is None:
        return None
    return RowExtras(
        row,
        req.finish_reason.value if req.finish_reason is not None else None,
        req.error,
        cached,
        [logprobs.token_logprob] if logprobs is not None else [],
        [logprobs.top] if logprobs is not None else [],
        prompt_logprobs=prompt_logprobs,
    )


def finished_alone(req: Req) -> TokenOutBatch:
    """The frame for a request that finished outside a step (rejected, aborted, no room)."""
    return TokenOutBatch([req.rid], token_counts=pack_int32([0]), extras=[row_extras(0, req)])


def unreadable_request(rid: str, why: str) -> TokenOutBatch:
    """The frame that ends a request whose own frame could not be read (codec.UnreadableRequest):
    its client gets an error, not a wait without end."""
    extras = RowExtras(0, FinishReason.ERROR.value, f"the scheduler could not read this request: {why}")
    return TokenOutBatch([rid], token_counts=pack_int32([0]), extras=[extras])


class StepOutputs(NamedTuple):
    batch: TokenOutBatch | None
    """For the tokenizer; None when every row was dropped."""
    tokens: int
    """Tokens added to requests."""
    finished: list[Req]
    """Requests this step finished."""


def result_mismatch(step_rows: int, batch_rows: int, result: StepResult, max_per_row: int) -> str | None:
    """Why `result` cannot be the answer to a step with `step_rows` sampling rows out of
    `batch_rows` (None if it can): its token, accept-length, logprob and seq_lens columns
    must fit those rows exactly, each row taking 1..`max_per_row` tokens. Checked before
    any token reaches a request, so a short or long result is refused, never truncated."""
    if len(result.next_token_ids) % 4 or len(result.accept_lens) % 4:
        return "token columns are not int32"
    n_tokens = len(result.next_token_ids) // 4
    if result.accept_lens:
        counts = unpack_int32(result.accept_lens)
        if len(counts) != step_rows:
            return f"{len(counts)} accept lengths for {step_rows} sampling rows"
        if len(counts) and (int(counts.min()) < 1 or int(counts.max()) > max_per_row):
            return f"an accept length outside 1..{max_per_row}"
        if int(counts.sum()) != n_tokens:
            return f"{n_tokens} tokens for accept lengths summing to {int(counts.sum())}"
    elif n_tokens != step_rows:
        return f"{n_tokens} tokens for {step_rows} sampling rows"
    if result.logprobs and len(result.logprobs) != step_rows:
        return f"{len(result.logprobs)} logprob rows for {step_rows} sampling rows"
    if result.seq_lens is not None and len(result.seq_lens) != 4 * batch_rows:
        return f"seq_lens of {len(result.seq_lens) // 4} rows for a batch of {batch_rows}"
    return None


def embeddings_mismatch(pooling_rows: int, result: StepResult) -> str | None:
    """Why `result` cannot answer a step whose last chunks of `pooling_rows` embedding rows
    ran (None if it can): it must carry exactly one vector for each."""
    got = result.embeddings.rows if result.embeddings is not None else 0
    if got != pooling_rows:
        return f"{got} embedding vectors for {pooling_rows} embedding rows"
    return None


def take_step_embeddings(reqs: list[Req], result: StepResult) -> StepOutputs:
    """Each embedding request of `reqs` (in batch order) gets its vector from `result`, and
    finishes with it; one whose request finished first (aborted) is dropped."""
    rids: list[str] = []
    extras: list[RowExtras] = []
    finished: list[Req] = []
    for i, req in enumerate(reqs):
        req.pending_results -= 1
        if req.finish_reason is not None:
            continue
        req.finish(FinishReason.STOP)
        finished.append(req)
        extras.append(RowExtras(len(rids), FinishReason.STOP.value, embedding=result.embeddings.row(i)))
        rids.append(req.rid)
    if not rids:
        return StepOutputs(None, 0, finished)
    return StepOutputs(TokenOutBatch(rids, token_counts=pack_int32([0] * len(rids)), extras=extras), 0, finished)


def take_step_tokens(reqs: list[Req], result: StepResult, row_by_row: bool = False) -> StepOutputs:
    """Adds each sampling row's tokens of `result` to its request (rows in `reqs` order)
    and returns what the step produced.

    A row whose request finished before its token arrived (overlap ran one step past the
    finish, or it was aborted) is dropped; accepted drafts past a stop are dropped too.
    `result` has passed `result_mismatch` (the worker link refuses any that does not fit).
    `row_by_row`: some row's first output carries prompt logprobs or is dropped (max_tokens 0)."""
    if result.accept_lens or result.logprobs or row_by_row:
        return _take_general(reqs, result)
    tokens = unpack_int32(result.next_token_ids)
    rids: list[str] = []
    extras: list[RowExtras] = []
    dropped: list[int] = []
    finished: list[Req] = []
    for i, (req, token) in enumerate(zip(reqs, tokens.tolist(), strict=True)):
        req.pending_results -= 1
        if req.finish_reason is not None:
            dropped.append(i)
            continue
        out = req.output_ids
        out.append(token)
        if token in req.stop_ids or len(out) >= req.max_output_len or len(out) == 1:
            out.pop()
            append_token(req, token)
            extra = row_extras(len(rids), req)
            if extra is not None:
                extras.append(extra)
            if req.finish_reason is not None:
                finished.append(req)
        rids.append(req.rid)
    if not rids:
        return StepOutputs(None, 0, finished)
    token_ids = pack_int32(np.delete(tokens, dropped)) if dropped else result.next_token_ids
    return StepOutputs(TokenOutBatch(rids, token_ids, extras=extras), len(rids), finished)


def _take_general(reqs: list[Req], result: StepResult) -> StepOutputs:
    """Several tokens per row (speculative decoding) or logprobs: row by row."""
    tokens = unpack_int32(result.next_token_ids).tolist()
    counts = unpack_int32(result.accept_lens).tolist() if result.accept_lens else [1] * len(reqs)
    rids: list[str] = []
    taken: list[int] = []
    taken_counts: list[int] = []
    extras: list[RowExtras] = []
    finished: list[Req] = []
    start = 0
    for i, (req, n) in enumerate(zip(reqs, counts, strict=True)):
        row_tokens = tokens[start : start + n]
        start += n
        req.pending_results -= 1
        if req.finish_reason is not None:
            continue
        before = len(req.output_ids)
        for token in row_tokens:
            append_token(req, token)
            if req.finish_reason is not None:
                break
        if req.prefill_only:  # its prompt ran; the token sampled after it is not kept
            del req.output_ids[before:]
            req.finish_reason = FinishReason.LENGTH
        new = req.output_ids[before:]
        lp = result.logprobs[i] if result.logprobs and not req.prefill_only else None
        extra = row_extras(len(rids), req, lp)
        if extra is not None:
            extras.append(extra)
        if req.finish_reason is not None:
            finished.append(req)
        rids.append(req.rid)
        taken.extend(new)
        taken_counts.append(len(new))
    if not rids:
        return StepOutputs(None, 0, finished)
    return StepOutputs(TokenOutBatch(rids, pack_int32(taken), pack_int32(taken_counts), extras), len(taken), finished)

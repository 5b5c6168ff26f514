"""vLLM's beam search (`use_beam_search` on both OpenAI routes), run in the tokenizer process
over ordinary one-token requests, as vLLM runs it in its API server.

Each step asks the model, for every live beam, for the 2 x width most likely next tokens (raw
logprobs; the radix cache holds each beam's prefix, so a step prefills one token a beam). Every
beam is extended by each of them, and the width extensions with the highest summed logprob
live on. An extension by an end-of-sequence token (unless `ignore_eos`) is a finished beam.
After max_tokens steps the finished and the live beams are ranked by summed logprob over
(generated length) ** length_penalty, the end token not counted, and the best width of them
are the answer, best first."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from tokenizer_proc.chat_protocol import ChatCompletionRequest
from tokenizer_proc.openai_request import scheduling_options
from tokenizer_proc.protocol import CompletionRequest
from tokenizer_proc.request_handle import RequestHandle, SchedulingOptions
from tokenizer_proc.request_manager import RequestManager
from tokenizer_proc.sampling import resolve_max_tokens
from tokenizer_proc.serving import ChoiceResult, collect
from tokenizer_proc.state import FrontendState
from trident.wire.frontend import SamplingParams


@dataclass
class Beam:
    """One hypothesis of a search: the tokens it generated and their summed logprob."""

    token_ids: list[int] = field(default_factory=list)
    """Generated so far; a stopped beam's last token is its end token."""
    cum_logprob: float = 0.0
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Each position's most likely tokens, as the step that chose it saw them."""
    finish_reason: str | None = None
    """Why it ended: "stop", an end token; "abort", the search was aborted while it lived;
    None, it ran out of steps ("length")."""

    def text_ids(self, with_end_token: bool = False) -> list[int]:
        """The ids its text decodes: the token that ended it is not text unless asked for, as a
        stop token is not."""
        return self.token_ids[:-1] if self.finish_reason == "stop" and not with_end_token else self.token_ids

    def score(self, length_penalty: float) -> float:
        length = max(len(self.token_ids) - (self.finish_reason == "stop"), 1)
        return self.cum_logprob / length**length_penalty

    def extended(self, token: int, logprob: float, top: list[tuple[int, float]], ends: bool) -> Beam:
        return Beam(
            [*self.token_ids, token],
            self.cum_logprob + logprob,
            [*self.token_logprobs, logprob],
            [*self.top_logprobs, top],
            "stop" if ends else None,
        )


async def beam_search(
    manager: RequestManager,
    request: Request | None,
    prompt_ids: Sequence[int],
    *,
    width: int,
    steps: int,
    length_penalty: float,
    end_ids: Collection[int],
    top_logprobs: int,
    scheduling: SchedulingOptions,
    rid: str,
) -> list[Beam]:
    """The `width` best beams after `steps` tokens at most, best first. `end_ids`: the tokens
    that finish a beam (none with ignore_eos); `top_logprobs`: how many of each position's
    most likely tokens a beam keeps (at least the 2 x width a step extends by); `rid`: the
    prefix of the steps' request ids (POST /abort with a prefix of it ends the search: the live
    beams finish with "abort"). Raises ClientDisconnected if the client leaves."""
    step_params = SamplingParams(
        max_new_tokens=1, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=max(2 * width, top_logprobs)
    )
    live, finished = [Beam()], []
    for step in range(steps):
        handles: list[RequestHandle] = []
        try:
            for b, beam in enumerate(live):
                handles += await manager.submit(
                    [*prompt_ids, *beam.token_ids],
                    step_params,
                    rids=[f"{rid}-step{step}-{b}"],
                    scheduling=scheduling,
                    stream=False,
                    first_index=b,
                )
        except BaseException:  # a refused beam (a full server: 503) takes the step's others with it
            for handle in handles:
                handle.close()
            raise
        results = await collect(request, handles)
        if any(not r.top_logprobs for r in results):  # aborted (POST /abort named the request)
            for beam in live:
                beam.finish_reason = "abort"
            break
        extensions = []
        for beam, result in zip(live, results, strict=True):
            top = result.top_logprobs[0]
            for token, logprob in top[: 2 * width]:
                ends = token in end_ids
                (finished if ends else extensions).append(beam.extended(token, logprob, top, ends))
        live = sorted(extensions, key=lambda beam: beam.cum_logprob, reverse=True)[:width]
        if not live:
            break
    return sorted(finished + live, key=lambda beam: beam.score(length_penalty), reverse=True)[:width]


async def all_or_none(searches: Sequence[Coroutine[Any, Any, list[Beam]]]) -> list[list[Beam]]:
    """Runs `searches` concurrently (their steps share the scheduler's batches); if one fails
    (a full server's 503, a client gone) or the caller is cancelled, the others are cancelled,
    which aborts their open steps."""
    tasks = [asyncio.ensure_future(search) for search in searches]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


async def beam_search_choices(
    st: FrontendState,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: Sequence[tuple[list[int], int | None]],
    top_logprobs: int,
    cid: str,
    max_tokens_param: str,
) -> list[ChoiceResult]:
    """Each prompt's n beams as its n choices (indices prompt * n + rank, best first), for the
    route to format as it formats sampled ones. `prompts`: (ids, max_tokens as the body asks
    it) of each; `top_logprobs`: how many of each position's likeliest tokens a choice shows;
    `max_tokens_param`: the field a budget past the context is a 400 about. Raises
    ClientDisconnected if the client leaves."""
    width = body.n
    end_ids = set(body.stop_token_ids or ()) | (set() if body.ignore_eos else set(st.manager.server_info.eos_token_ids))
    scheduling = scheduling_options(st, body)
    steps = [resolve_max_tokens(len(ids), max_tokens, st.limits, max_tokens_param) for ids, max_tokens in prompts]
    # One search watches for the client leaving (its ClientDisconnected cancels the others):
    # concurrent readers of one request's messages would race for the disconnect.
    searches = [
        beam_search(
            st.manager,
            request if i == 0 else None,
            prompt_ids,
            width=width,
            steps=n,
            length_penalty=body.length_penalty,
            end_ids=end_ids,
            top_logprobs=top_logprobs,
            scheduling=scheduling,
            rid=f"{cid}-{i}",
        )
        for i, ((prompt_ids, _), n) in enumerate(zip(prompts, steps, strict=True))
    ]
    choices = []
    for i, ((prompt_ids, _), beams) in enumerate(zip(prompts, await all_or_none(searches), strict=True)):
        for rank, beam in enumerate(beams):
            shown = beam.text_ids(with_end_token=body.include_stop_str_in_output)
            choices.append(
                ChoiceResult(
                    i * width + rank,
                    st.tokenizer.decode(shown, skip_special_tokens=body.skip_special_tokens),
                    beam.token_ids,
                    beam.token_logprobs,
                    [top[:top_logprobs] for top in beam.top_logprobs],
                    beam.finish_reason or "length",
                    prompt_tokens=len(prompt_ids),
                    completion_tokens=len(beam.token_ids),
                )
            )
    return choices

"""vLLM's beam search (`use_beam_search` on /v1/completions), run in the tokenizer process over
ordinary one-token requests, as vLLM runs it in its API server.

Each step asks the model, for every live beam, for the 2 x width most likely next tokens (raw
logprobs; the radix cache holds each beam's prefix, so a step prefills one token a beam). Every
beam is extended by each of them, and the width extensions with the highest summed logprob
live on. An extension by an end-of-sequence token (unless `ignore_eos`) is a finished beam.
After max_tokens steps the finished and the live beams are ranked by summed logprob over
(generated length) ** length_penalty, the end token not counted, and the best width of them
are the answer, best first."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from tokenizer_proc import openai_format as fmt
from tokenizer_proc.openai_request import beam_width, scheduling_options, token_strings
from tokenizer_proc.protocol import COMPLETION_DEFAULT_MAX_TOKENS, CompletionRequest
from tokenizer_proc.request_handle import SchedulingOptions
from tokenizer_proc.request_manager import RequestManager
from tokenizer_proc.sampling import resolve_max_tokens
from tokenizer_proc.serving import CLIENT_CLOSED, ClientDisconnected, collect, usage_dict
from tokenizer_proc.state import FrontendState
from trident.wire.frontend import SamplingParams


@dataclass
class Beam:
    token_ids: list[int] = field(default_factory=list)
    """Generated so far; a finished beam's last token is its end-of-sequence token."""
    cum_logprob: float = 0.0
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Each position's most likely tokens, as the step that chose it saw them."""
    finished: bool = False
    """It ended in an end-of-sequence token."""

    def score(self, length_penalty: float) -> float:
        length = max(len(self.token_ids) - self.finished, 1)
        return self.cum_logprob / length**length_penalty

    def extended(self, token: int, logprob: float, top: list[tuple[int, float]], finished: bool) -> Beam:
        return Beam(
            [*self.token_ids, token],
            self.cum_logprob + logprob,
            [*self.token_logprobs, logprob],
            [*self.top_logprobs, top],
            finished,
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
    prefix of the steps' request ids. Raises ClientDisconnected if the client leaves."""
    step_params = SamplingParams(
        max_new_tokens=1, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=max(2 * width, top_logprobs)
    )
    live, finished = [Beam()], []
    for step in range(steps):
        handles = []
        for b, beam in enumerate(live):
            handles += await manager.submit(
                [*prompt_ids, *beam.token_ids],
                step_params,
                rids=[f"{rid}-step{step}-{b}"],
                scheduling=scheduling,
                stream=False,
                first_index=b,
            )
        results = await collect(request, handles)
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


async def beam_search_completion(
    st: FrontendState, body: CompletionRequest, request: Request, prompts: list[tuple[str, list[int]]], cid: str
) -> Response:
    """The /v1/completions answer of a beam search: each prompt's n beams are its n choices,
    best first; the usage counts the tokens of the beams returned."""
    width = beam_width(body)
    end_ids = set(body.stop_token_ids or ()) | (set() if body.ignore_eos else set(st.manager.server_info.eos_token_ids))
    strings = token_strings(st, body)
    choices, completion_tokens = [], 0
    for i, (echo, prompt_ids) in enumerate(prompts):
        max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, min(COMPLETION_DEFAULT_MAX_TOKENS, st.limits.context_length - len(prompt_ids)))
        steps = resolve_max_tokens(len(prompt_ids), max_tokens, st.limits, "max_tokens")
        try:
            beams = await beam_search(
                st.manager,
                request,
                prompt_ids,
                width=width,
                steps=steps,
                length_penalty=body.length_penalty,
                end_ids=end_ids,
                top_logprobs=body.logprobs or 0,
                scheduling=scheduling_options(st, body),
                rid=f"{cid}-{i}",
            )
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        for rank, beam in enumerate(beams):
            logprobs = None
            if body.logprobs is not None:
                tops = [top[: body.logprobs] for top in beam.top_logprobs]
                logprobs = fmt.CompletionLogprobs(strings).part(beam.token_ids, beam.token_logprobs, tops)
            # The token that ended a beam is not its text (unless asked for), as a stop token is not.
            shown = beam.token_ids[:-1] if beam.finished and not body.include_stop_str_in_output else beam.token_ids
            text = echo + st.tokenizer.decode(shown, skip_special_tokens=body.skip_special_tokens)
            ids = fmt.TokenIds(beam.token_ids, prompt_ids) if body.return_token_ids else None
            finish = "stop" if beam.finished else "length"
            choices.append(fmt.completion_choice(i * width + rank, text, logprobs, finish, None, ids))
            completion_tokens += len(beam.token_ids)
    usage = usage_dict(sum(len(ids) for _, ids in prompts), completion_tokens, 0)
    body_out = fmt.completion_body(cid, int(time.time()), st.args.served_model_name, choices, usage)
    return JSONResponse(body_out)

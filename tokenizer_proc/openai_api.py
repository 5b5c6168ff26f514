"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Each handler validates (protocol models, then `sampling` against the model), resolves the
body (`openai_request`: prompts, constraint, sampling, scheduling options, name), submits n
requests with rids `{id}-{i}` through the `RequestManager`, and answers either with one
JSON body (`serving.collect`) or with server-sent events. Response shapes are built by
`openai_format`; decoding constraints come from `structured`, tool calls from `tools`. A
chat choice's text goes through `chat_output` (reasoning and tool-call parsers) whether
streamed or not; a stream holds back only the text that may begin a call or a tag.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenizer_proc import openai_format as fmt
from tokenizer_proc.beam_search import beam_search_choices
from tokenizer_proc.chat_output import ChoiceOutput, choice_output
from tokenizer_proc.chat_protocol import ChatCompletionRequest
from tokenizer_proc.errors import APIError
from tokenizer_proc.openai_request import (
    beam_width,
    best_of_each_prompt,
    candidates_per_prompt,
    completion_prompts,
    prompt_logprobs_of,
    request_constraint,
    request_name,
    resolve_chat,
    sampling_request,
    scheduling_options,
    token_strings,
)
from tokenizer_proc.protocol import COMPLETION_DEFAULT_MAX_TOKENS, CompletionRequest
from tokenizer_proc.request_handle import RequestHandle
from tokenizer_proc.sampling import (
    SamplingRequest,
    build_sampling_params,
    check_model,
    with_seed_offset,
)
from tokenizer_proc.serving import (
    CLIENT_CLOSED,
    SSE_DONE,
    ChoiceResult,
    ClientDisconnected,
    collect,
    merge_outputs,
    sse,
    stream_error_event,
    usage_of,
)
from tokenizer_proc.state import FrontendState, get_state
from tokenizer_proc.tokenization import bad_word_sequences
from trident.wire.frontend import GrammarSpec

router = APIRouter()


class EventStreamResponse(StreamingResponse):
    """SSE response that closes (aborts) its requests however the stream ends, even unstarted."""

    def __init__(self, content: AsyncIterator[bytes], handles: Sequence[RequestHandle]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._handles = handles

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for handle in self._handles:
                handle.close()


async def submit_choices(
    st: FrontendState,
    prompt_ids: list[int],
    body: CompletionRequest | ChatCompletionRequest,
    sreq: SamplingRequest,
    cid: str,
    max_tokens_param: str,
    choices: int,
    first_index: int = 0,
) -> list[RequestHandle]:
    """The `choices` choices of one prompt (n, or completions' best_of), indices
    `first_index` on (a batch's later prompts)."""
    prompt_param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    params = build_sampling_params(sreq, len(prompt_ids), st.limits, max_tokens_param, prompt_param)
    indices = range(first_index, first_index + choices)
    return await st.manager.submit(
        prompt_ids,
        [with_seed_offset(params, i) for i in indices],
        rids=[f"{cid}-{i}" for i in indices],
        rids_param="request_id",
        text=body.text_options(),
        scheduling=scheduling_options(st, body),
        stream=bool(body.stream),
        first_index=first_index,
    )


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    """OpenAI's list (a card for each of the model's names), with the page fields Anthropic's
    client reads beside it."""
    st = get_state(request)
    names = st.limits.served_model_names
    cards = [_model_card(st, name) for name in names]
    return {"object": "list", "data": cards, "has_more": False, "first_id": names[0], "last_id": names[-1]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request) -> dict[str, Any]:
    st = get_state(request)
    check_model(model, st.limits)
    return _model_card(st, model)


def _model_card(st: FrontendState, name: str) -> dict[str, Any]:
    """The served model as OpenAI's clients read it (`object`, `created`, `owned_by`; vLLM's
    `max_model_len`) and as Anthropic's do (`type`, `display_name`, `created_at`, ...)."""
    context = st.limits.context_length
    return {
        "id": name,
        "object": "model",
        "created": st.started_at,
        "owned_by": "trident",
        "max_model_len": context,
        "type": "model",
        "display_name": name,
        "created_at": datetime.fromtimestamp(st.started_at, timezone.utc).isoformat(),
        "lifecycle": "active",
        "max_input_tokens": context,
    }


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    """A batch of prompts (OpenAI's and vLLM's list prompt) gives each prompt n choices:
    prompt i's are indices i * n to i * n + n - 1, each with its own prompt's echo. With
    best_of, a prompt runs that many candidates and its n best are its choices; with
    use_beam_search, its n best beams are."""
    st = get_state(request)
    check_model(body.model, st.limits)
    prompts = completion_prompts(st, body)
    cid = f"cmpl-{request_name(body, request)}"
    constraint = request_constraint(body)
    # None: the model's default budget or OpenAI's, or the context left if less (a full
    # prompt still gets resolve_max_tokens' 400).
    budgets = [
        body.max_tokens
        if body.max_tokens is not None
        else st.limits.default_max_tokens(len(ids), COMPLETION_DEFAULT_MAX_TOKENS)
        for _, ids in prompts
    ]
    want_lp = body.logprobs is not None
    created = int(time.time())
    model = st.args.served_model_name
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    prompt_of = [prompts[i // body.n] for i in range(len(prompts) * body.n)]  # (echo, ids) of each choice
    candidates = beam_width(body, constraint) if body.use_beam_search else candidates_per_prompt(body)
    try:
        if body.use_beam_search:
            searched = [(ids, budget) for (_, ids), budget in zip(prompts, budgets)]
            ran = await beam_search_choices(st, request, body, searched, body.logprobs or 0, cid, "max_tokens")
        else:
            handles = await _submit_completion_choices(st, body, prompts, budgets, candidates, constraint, cid)
            if body.stream:
                gen = _stream_completion(st, body, handles, cid, created, model, prompt_of, prompt_tokens)
                return EventStreamResponse(gen, handles)
            ran = await collect(request, handles)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    results = best_of_each_prompt(ran, candidates, body.n) if candidates > body.n else ran
    choices = []
    for r in results:
        prompt_text, prompt_ids = prompt_of[r.index]
        logprobs = None
        if want_lp:
            builder = fmt.CompletionLogprobs(token_strings(st, body))
            logprobs = builder.prompt_part(prompt_ids, r.prompt_logprobs, body.logprobs) if body.echo else None
            part = builder.part(r.token_ids, r.token_logprobs, r.top_logprobs)
            logprobs = fmt.merge_completion_logprobs(logprobs, part)
        prompt_lps = prompt_logprobs_of(st, body, prompt_ids, r)
        text = prompt_text + r.text
        ids = fmt.TokenIds(r.token_ids, prompt_ids) if body.return_token_ids else None
        choices.append(fmt.completion_choice(r.index, text, logprobs, r.finish_reason, prompt_lps, ids, r.stop_reason))
    return JSONResponse(fmt.completion_body(cid, created, model, choices, usage_of(ran, prompt_tokens)))


async def _submit_completion_choices(
    st: FrontendState,
    body: CompletionRequest,
    prompts: list[tuple[str, list[int]]],
    budgets: list[int],
    candidates: int,
    constraint: GrammarSpec | None,
    cid: str,
) -> list[RequestHandle]:
    """`candidates` choices of each prompt (n, or best_of), `budgets` its max_tokens."""
    bad_words_ids = bad_word_sequences(st.tokenizer, body.bad_words)
    # Ranking best_of's candidates needs their tokens' logprobs, asked for or not.
    logprobs = body.logprobs is not None or candidates > body.n
    echo_lp = body.logprobs if body.echo else None
    handles: list[RequestHandle] = []
    try:
        for i, ((_, prompt_ids), budget) in enumerate(zip(prompts, budgets)):
            sreq = sampling_request(body, budget, logprobs, body.logprobs or 0, constraint, bad_words_ids, echo_lp)
            handles += await submit_choices(st, prompt_ids, body, sreq, cid, "max_tokens", candidates, i * candidates)
    except BaseException:
        for handle in handles:
            handle.close()
        raise
    return handles


async def _stream_completion(
    st: FrontendState,
    body: CompletionRequest,
    handles: Sequence[RequestHandle],
    cid: str,
    created: int,
    model: str,
    prompt_of: list[tuple[str, list[int]]],
    prompt_tokens: int,
) -> AsyncIterator[bytes]:
    include_usage, usage_in_every_chunk = body.include_usage(), body.usage_in_every_chunk()
    want_lp = body.logprobs is not None
    builders = [fmt.CompletionLogprobs(token_strings(st, body)) for _ in handles]
    results = [ChoiceResult(i) for i in range(len(handles))]
    ids = fmt.StreamedTokenIds(len(handles), prompt_per_choice=True) if body.return_token_ids else None

    def chunk(
        index: int, text: str, logprobs: dict | None, finish: str | None, prompt_lps: list | None = None
    ) -> bytes:
        chunk_ids = ids.take(index, prompt_of[index][1]) if ids else None
        stop_reason = results[index].stop_reason
        choice = fmt.completion_choice(index, text, logprobs, finish, prompt_lps, chunk_ids, stop_reason)
        obj = fmt.completion_body(cid, created, model, [choice], None)
        if include_usage:
            obj["usage"] = usage_of(results, prompt_tokens) if usage_in_every_chunk else None
        return sse(obj)

    # Prompt logprobs come with a choice's first output: what shows them waits for it.
    waits_for_prompt = (body.echo and want_lp) or body.prompt_logprobs is not None
    if body.echo and not waits_for_prompt:
        for i, (prompt_text, _) in enumerate(prompt_of):
            yield chunk(i, prompt_text, None, None)
    started: set[int] = set()
    async for out in merge_outputs(handles):
        first = out.index not in started
        started.add(out.index)
        results[out.index].add(out)
        if ids:
            ids.hold(out.index, out.token_ids)
        if out.finish_reason == "error":
            yield stream_error_event(f"generation failed: {out.error or 'unknown error'}")
            yield SSE_DONE
            return
        if waits_for_prompt and first:
            r = results[out.index]
            prompt_text, prompt_ids = prompt_of[out.index]
            lp = (
                builders[out.index].prompt_part(prompt_ids, r.prompt_logprobs, body.logprobs)
                if body.echo and want_lp
                else None
            )
            yield chunk(out.index, prompt_text, lp, None, prompt_logprobs_of(st, body, prompt_ids, r))
        lp = None
        if want_lp and out.token_ids:
            lp = builders[out.index].part(out.token_ids, out.token_logprobs, out.top_logprobs)
        if out.text or lp is not None or out.finish_reason is not None:
            yield chunk(out.index, out.text, lp, out.finish_reason)
    if include_usage:
        yield sse(fmt.usage_chunk(cid, created, model, "text_completion", usage_of(results, prompt_tokens)))
    yield SSE_DONE


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    st = get_state(request)
    check_model(body.model, st.limits)
    if body.stream and body.prompt_logprobs is not None:  # vLLM refuses them too: a chat chunk has no place for them
        raise APIError(
            "`prompt_logprobs` are not available when `stream=True` on /v1/chat/completions (as in vLLM): "
            "ask without streaming, or stream /v1/completions, whose first chunk carries them.",
            param="prompt_logprobs",
        )
    chat = resolve_chat(st, body)
    prompt_ids, param = chat.prompt_ids, chat.max_tokens_param
    cid = f"chatcmpl-{request_name(body, request)}"
    created = int(time.time())
    model = st.args.served_model_name
    outputs = [choice_output(chat.plan, st.tool_format, st.model_reasons, chat.prompt_text) for _ in range(body.n)]
    try:
        if body.use_beam_search:
            beam_width(body, chat.grammar, "tool_choice" if chat.plan.forced else "response_format")
            searched = [(prompt_ids, chat.max_tokens)]
            results = await beam_search_choices(st, request, body, searched, body.top_logprobs or 0, cid, param)
        else:
            handles = await submit_choices(st, prompt_ids, body, chat.sampling, cid, param, body.n)
            if body.stream:
                stream = _stream_chat(st, body, outputs, handles, cid, created, model, prompt_ids)
                return EventStreamResponse(stream, handles)
            results = await collect(request, handles)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    choices = []
    for r in results:
        output = outputs[r.index]
        output.feed(r.text, r.finish_reason)
        logprobs = (
            fmt.chat_logprobs(token_strings(st, body), r.token_ids, r.token_logprobs, r.top_logprobs)
            if body.logprobs
            else None
        )
        token_ids = r.token_ids if body.return_token_ids else None
        message = output.message()
        if body.echoed_text():
            message["content"] = body.echoed_text() + (message["content"] or "")
        choices.append(fmt.chat_choice(r.index, message, logprobs, output.finish_reason, token_ids, r.stop_reason))
    usage = usage_of(results, len(prompt_ids))
    response = fmt.chat_body(cid, created, model, choices, usage)
    if body.return_token_ids:
        response["prompt_token_ids"] = prompt_ids
    if body.prompt_logprobs is not None:  # vLLM's place for them in a chat response: the top level
        response["prompt_logprobs"] = prompt_logprobs_of(st, body, prompt_ids, results[0])
    return JSONResponse(response)


async def _stream_chat(
    st: FrontendState,
    body: ChatCompletionRequest,
    outputs: Sequence[ChoiceOutput],
    handles: Sequence[RequestHandle],
    cid: str,
    created: int,
    model: str,
    prompt_ids: list[int],
) -> AsyncIterator[bytes]:
    include_usage = body.include_usage()
    results = [ChoiceResult(i) for i in range(len(handles))]
    usage_in_every_chunk = body.usage_in_every_chunk()
    ids = fmt.StreamedTokenIds(len(handles), prompt_per_choice=False) if body.return_token_ids else None

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> bytes:
        chunk_ids = ids.take(index, prompt_ids) if ids else None
        stop_reason = results[index].stop_reason
        obj = fmt.chat_chunk(cid, created, model, index, delta, finish, logprobs, include_usage, chunk_ids, stop_reason)
        if usage_in_every_chunk:
            obj["usage"] = usage_of(results, len(prompt_ids))
        return sse(obj)

    for i in range(len(handles)):
        yield chunk(i, {"role": "assistant", "content": body.echoed_text()})
    async for out in merge_outputs(handles):
        results[out.index].add(out)
        if ids:
            ids.hold(out.index, out.token_ids)
        if out.finish_reason == "error":
            yield stream_error_event(f"generation failed: {out.error or 'unknown error'}")
            yield SSE_DONE
            return
        lp = None
        if body.logprobs and out.token_ids:
            lp = fmt.chat_logprobs(token_strings(st, body), out.token_ids, out.token_logprobs, out.top_logprobs)
        output = outputs[out.index]
        delta = output.feed(out.text, out.finish_reason)  # text a call may begin is held back
        if delta or lp is not None:
            yield chunk(out.index, delta, logprobs=lp)
        if out.finish_reason is not None:
            yield chunk(out.index, {}, output.finish_reason)
    if include_usage:
        yield sse(fmt.usage_chunk(cid, created, model, "chat.completion.chunk", usage_of(results, len(prompt_ids))))
    yield SSE_DONE

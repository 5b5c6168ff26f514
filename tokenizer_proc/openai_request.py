"""What an OpenAI request body resolves to before it is submitted: its prompts (completion
prompts cut to `truncate_prompt_tokens`, a chat through its template), its one decoding
constraint, its sampling request, its scheduling options (cache salt, priority), its name
(`request_id`), how many candidates a prompt runs (`best_of`) and how the best are chosen,
what a beam search takes, and how its logprobs name tokens. The routes in `openai_api` call
these; a 400 for anything the body asks that cannot be done."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from tokenizer_proc.chat_protocol import ChatCompletionRequest, ChatPrompt
from tokenizer_proc.errors import APIError
from tokenizer_proc.prompt_logprobs_format import vllm_prompt_logprobs
from tokenizer_proc.protocol import MAX_BEAM_WIDTH, MAX_REQUEST_ID_CHARS, CompletionRequest
from tokenizer_proc.reasoning import thinking_open_in, thinking_skipped_in
from tokenizer_proc.request_handle import SchedulingOptions
from tokenizer_proc.sampling import SamplingRequest, check_prompt_ids, last_prompt_tokens
from tokenizer_proc.serving import ChoiceResult
from tokenizer_proc.state import FrontendState
from tokenizer_proc.structured import (
    after_reasoning,
    one_constraint,
    response_format_spec,
    sglang_constraint,
    vllm_constraint,
)
from tokenizer_proc.tokenization import (
    TokenIdStrings,
    TokenStrings,
    apply_chat_template,
    bad_word_sequences,
    encode_text,
)
from tokenizer_proc.tool_parsers import HERMES
from tokenizer_proc.tools import ToolPlan, forced_call_spec, plan_of, template_messages, template_renders_tools
from trident.wire.frontend import GrammarSpec


def request_constraint(
    body: CompletionRequest | ChatCompletionRequest, forced_call: GrammarSpec | None = None
) -> GrammarSpec | None:
    """The one constraint of an OpenAI request: response_format, an SGLang field, vLLM's
    structured_outputs (or its older guided_* fields), or a tool_choice that forces a call."""
    return one_constraint(
        {
            "response_format": response_format_spec(body.response_format),
            "regex/ebnf/json_schema": sglang_constraint(body.regex, body.ebnf, body.json_schema),
            "structured_outputs": vllm_constraint(body.structured_outputs),
            "guided_*": vllm_constraint(body.guided_outputs(), legacy=True),
            "tool_choice": forced_call,
        }
    )


def sampling_request(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
    grammar: GrammarSpec | None,
    bad_words_ids: list[list[int]],
    echo_logprobs: int | None = None,
) -> SamplingRequest:
    """`bad_words_ids`: the body's bad_words, tokenized (tokenization.bad_word_sequences);
    `echo_logprobs`: the top logprobs an echoed prompt shows (completions' echo with logprobs)."""
    prompt_tops = [k for k in (echo_logprobs, body.prompt_logprobs) if k is not None]
    return SamplingRequest(
        body.knobs(),
        max_tokens,
        logprobs,
        top_logprobs,
        body.logit_bias,
        grammar,
        prompt_logprobs_from=0 if prompt_tops else -1,
        prompt_top_logprobs=max(prompt_tops, default=0),
        bad_words_ids=bad_words_ids,
    )


def scheduling_options(st: FrontendState, body: CompletionRequest | ChatCompletionRequest) -> SchedulingOptions:
    """The request's cache salt and priority; a priority needs a server that schedules by it."""
    if body.priority and st.args.schedule_policy != "priority":
        raise APIError(
            f"priority needs a server started with --schedule-policy priority (this one: {st.args.schedule_policy}).",
            param="priority",
        )
    return SchedulingOptions(body.cache_salt or "", body.priority)


def request_name(body: CompletionRequest | ChatCompletionRequest, request: Request) -> str:
    """The client's name for the request (`request_id`, else the X-Request-Id header), else a
    random one."""
    if body.request_id is not None:
        return body.request_id
    header = request.headers.get("x-request-id")
    if header is None:
        return uuid.uuid4().hex
    if not 0 < len(header) <= MAX_REQUEST_ID_CHARS:
        raise APIError(f"X-Request-Id must be 1-{MAX_REQUEST_ID_CHARS} characters.", param="X-Request-Id")
    return header


TOKEN_ID_STRINGS = TokenIdStrings()


def token_strings(st: FrontendState, body: CompletionRequest | ChatCompletionRequest) -> TokenStrings:
    """How this request's logprobs name tokens: their text, or `token_id:<id>` when asked."""
    return TOKEN_ID_STRINGS if body.return_tokens_as_token_ids else st.strings


def prompt_logprobs_of(
    st: FrontendState, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int], r: ChoiceResult
) -> list[Any] | None:
    """vLLM's `prompt_logprobs` of a choice, when the request asked for them."""
    if body.prompt_logprobs is None:
        return None
    return vllm_prompt_logprobs(token_strings(st, body), prompt_ids, r.prompt_logprobs, body.prompt_logprobs)


def candidates_per_prompt(body: CompletionRequest) -> int:
    """How many choices each prompt runs: `best_of` when given, else n."""
    if body.best_of is None:
        return body.n
    if body.best_of < body.n:
        raise APIError(f"best_of ({body.best_of}) must be at least n ({body.n}).", param="best_of")
    if body.stream and body.best_of > body.n:
        raise APIError("best_of larger than n cannot be streamed: the best are known only at the end.", param="best_of")
    return body.best_of


def beam_width(
    body: CompletionRequest | ChatCompletionRequest,
    constraint: GrammarSpec | None,
    constraint_param: str = "response_format",
) -> int:
    """n, the beams a beam search keeps; a 400 for what beam search does not take
    (`constraint`: the request's resolved one, from the field `constraint_param`). Sampling
    knobs (temperature, top_p, ...) do not apply: beams rank by the model's own logprobs."""
    if body.stream:
        raise APIError("Beam search answers once every beam is done: it cannot be streamed.", param="stream")
    if body.n > MAX_BEAM_WIDTH:
        raise APIError(f"Beam search keeps at most {MAX_BEAM_WIDTH} beams (n).", param="n")
    echo = isinstance(body, CompletionRequest) and body.echo and body.logprobs is not None
    refused = {
        "best_of": isinstance(body, CompletionRequest) and body.best_of is not None,
        "stop": bool(body.stop),
        "logit_bias": bool(body.logit_bias),
        "allowed_token_ids": bool(body.allowed_token_ids),
        "bad_words": bool(body.bad_words),
        "prompt_logprobs": body.prompt_logprobs is not None,
        "echo": echo,
        constraint_param: constraint is not None,
    }
    for param, asked in refused.items():
        if asked:
            raise APIError(f"{param} cannot be used with use_beam_search.", param=param)
    return body.n


def best_of_each_prompt(results: list[ChoiceResult], candidates: int, n: int) -> list[ChoiceResult]:
    """The n candidates of each prompt (`candidates` in a row, in `results`' order) whose
    sampled tokens have the highest mean logprob, best first, indexed as n choices a prompt
    are. A tie keeps the earlier candidate first."""
    best = []
    for first in range(0, len(results), candidates):
        ranked = sorted(results[first : first + candidates], key=_mean_logprob, reverse=True)
        for rank, r in enumerate(ranked[:n]):
            r.index = first // candidates * n + rank
            best.append(r)
    return best


def _mean_logprob(r: ChoiceResult) -> float:
    return sum(r.token_logprobs) / len(r.token_logprobs) if r.token_logprobs else 0.0


def completion_prompts(st: FrontendState, body: CompletionRequest) -> list[tuple[str, list[int]]]:
    """(echo, ids) of each prompt of a completions request (a string, token ids, or a batch of
    either), each cut to `truncate_prompt_tokens`; `echo`: the text that echo shows, the
    prompt's own or its ids decoded ("" without echo)."""
    prompt = body.prompt
    single = isinstance(prompt, str) or not prompt or isinstance(prompt[0], int)
    out = []
    for one in [prompt] if single else prompt:
        if isinstance(one, str) and not one:
            raise APIError("The prompt is empty.", param="prompt", code="empty_prompt")
        if body.suffix is not None:
            one = _fill_in_the_middle(st, body, one)
        ids = encode_text(st.tokenizer, one) if isinstance(one, str) else list(one)
        kept = last_prompt_tokens(ids, body.truncate_prompt_tokens, st.limits)
        check_prompt_ids(kept, st.limits, "prompt")
        text = one if isinstance(one, str) and kept is ids else st.tokenizer.decode(kept)
        out.append((text if body.echo else "", kept))
    return out


def _fill_in_the_middle(st: FrontendState, body: CompletionRequest, prefix: str | list[int]) -> str:
    """The prompt that asks for the text between `prefix` and the body's suffix."""
    if st.fim_tokens is None:
        raise APIError(
            f"suffix needs a model with fill-in-the-middle tokens; {st.args.served_model_name} has none.",
            param="suffix",
        )
    if not isinstance(prefix, str):
        raise APIError("suffix goes with text prompts, not token ids.", param="suffix")
    if body.echo:
        raise APIError("echo and suffix cannot be used together.", param="suffix")
    first, second, third = st.fim_tokens
    return f"{first}{prefix}{second}{body.suffix}{third}"


def render_chat(st: FrontendState, prompt: ChatPrompt, plan: ToolPlan) -> tuple[str, list[int]]:
    """(text, ids) of a conversation through the model's chat template; a 400 when the
    template refuses it."""
    if prompt.chat_template is not None and not st.args.trust_request_chat_template:
        raise APIError(
            "This server runs only its model's chat template: a request's `chat_template` needs a server "
            "started with --trust-request-chat-template.",
            param="chat_template",
        )
    native_tools = template_renders_tools(prompt.chat_template or getattr(st.tokenizer, "chat_template", None))
    as_template_takes = template_messages(prompt.messages, plan, native_tools, st.tool_format or HERMES)
    tools = [{"type": "function", "function": t} for t in plan.tools] if native_tools and plan.mode != "none" else None
    try:
        return apply_chat_template(
            st.tokenizer,
            as_template_takes,
            tools,
            add_generation_prompt=prompt.generation_prompt(),
            continue_final_message=prompt.continue_final_message,
            template_kwargs={**(st.args.default_chat_template_kwargs or {}), **prompt.template_variables()},
            add_special_tokens=prompt.add_special_tokens,
            chat_template=prompt.chat_template,
            documents=prompt.documents,
        )
    except Exception as e:  # the template rejects this conversation (e.g. role order)
        raise APIError(f"The messages do not fit the model's chat template: {e}", param="messages") from e


@dataclass(frozen=True)
class ResolvedChat:
    """A chat request ready to submit: its prompt through the template, its constraint and
    its sampling request (what /v1/chat/completions and /v1/responses share)."""

    plan: ToolPlan
    grammar: GrammarSpec | None
    """The one constraint (response_format, a forced tool call, ...), after the reasoning
    when the model reasons."""
    prompt_text: str
    prompt_ids: list[int]
    max_tokens: int | None
    max_tokens_param: str
    """The field the budget came from (max_completion_tokens or max_tokens), for errors."""
    sampling: SamplingRequest


def resolve_chat(st: FrontendState, body: ChatCompletionRequest) -> ResolvedChat:
    plan = plan_of(body)
    forced = forced_call_spec(plan, st.tool_format, body.parallel_tool_calls) if plan.forced else None
    grammar = request_constraint(body, forced)
    prompt_text, prompt_ids = render_chat(st, body, plan)
    prompt_ids = last_prompt_tokens(prompt_ids, body.truncate_prompt_tokens, st.limits)
    if grammar is not None and st.model_reasons and not thinking_skipped_in(prompt_text):
        grammar = after_reasoning(grammar, thinking_open_in(prompt_text))
    check_prompt_ids(prompt_ids, st.limits, "messages")
    use_mct = body.max_completion_tokens is not None
    max_tokens = body.max_completion_tokens if use_mct else body.max_tokens
    if max_tokens is None:
        max_tokens = st.limits.default_max_tokens(len(prompt_ids), None)
    bad_words_ids = bad_word_sequences(st.tokenizer, body.bad_words)
    sreq = sampling_request(body, max_tokens, body.logprobs, body.top_logprobs or 0, grammar, bad_words_ids)
    param = "max_completion_tokens" if use_mct else "max_tokens"
    return ResolvedChat(plan, grammar, prompt_text, prompt_ids, max_tokens, param, sreq)

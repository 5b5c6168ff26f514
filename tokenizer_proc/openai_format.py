"""OpenAI response bodies: completion and chat objects, stream chunks, logprobs formats.

Pure functions from accumulated results to JSON-ready dicts; the routes in `openai_api`
decide when to send what. Token ids become strings here, through `TokenStrings`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizer_proc.prompt_logprobs_format import echo_entries
from tokenizer_proc.tokenization import TokenStrings
from trident.wire.logprobs import PromptLogprobs


def client_finish_reason(reason: str | None) -> str | None:
    """What clients see: stop | length | tool_calls | abort (an error is reported as an
    error, not here)."""
    if reason is None or reason in ("stop", "length", "tool_calls", "abort"):
        return reason
    return "abort"


@dataclass
class TokenIds:
    """vLLM's `return_token_ids` fields of one choice or chunk."""

    output: list[int]
    """The output's ids (a chunk's: those since the previous chunk)."""
    prompt: list[int] | None = None
    """The prompt's ids, where the response carries them (a streamed choice: its first chunk)."""


class StreamedTokenIds:
    """vLLM's `return_token_ids` in a stream: each chunk carries the ids its choice produced
    since that choice's previous chunk (ids whose text is held back, a possible stop string,
    go with the next chunk), and the prompt's ids go in the first chunk: of each choice
    (completions: each has its own prompt) or of the stream (chat: one prompt)."""

    def __init__(self, choices: int, prompt_per_choice: bool) -> None:
        self._held: list[list[int]] = [[] for _ in range(choices)]
        self._prompt_sent: set[int] = set()
        self._prompt_per_choice = prompt_per_choice

    def hold(self, index: int, token_ids: Sequence[int]) -> None:
        self._held[index].extend(token_ids)

    def take(self, index: int, prompt_ids: list[int]) -> TokenIds:
        """What the next chunk of choice `index` carries."""
        key = index if self._prompt_per_choice else 0
        prompt = None if key in self._prompt_sent else prompt_ids
        self._prompt_sent.add(key)
        output, self._held[index] = self._held[index], []
        return TokenIds(output, prompt)


class CompletionLogprobs:
    """Builds the legacy completions `logprobs` object, chunk by chunk (offsets carry over)."""

    def __init__(self, strings: TokenStrings, text_offset: int = 0) -> None:
        self._strings = strings
        self._offset = text_offset

    def prompt_part(self, prompt_ids: Sequence[int], scored: PromptLogprobs | None, k: int) -> dict[str, Any]:
        """The echoed prompt: its tokens, each with its logprob and top k (none for the first)."""
        tokens = [self._strings.text(t) for t in prompt_ids]
        logprobs, tops = echo_entries(self._strings, prompt_ids, scored, k)
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": tops,
            "text_offset": self._advance(tokens),
        }

    def part(
        self, token_ids: Sequence[int], token_logprobs: Sequence[float], top: Sequence[Sequence[tuple[int, float]]]
    ) -> dict[str, Any]:
        tokens = [self._strings.text(t) for t in token_ids]
        tops: list[dict[str, float] | None] = []
        for i in range(len(tokens)):
            pairs = top[i] if i < len(top) else []
            tops.append({self._strings.text(tid): lp for tid, lp in pairs})
        return {
            "tokens": tokens,
            "token_logprobs": list(token_logprobs)[: len(tokens)],
            "top_logprobs": tops,
            "text_offset": self._advance(tokens),
        }

    def _advance(self, tokens: Sequence[str]) -> list[int]:
        offsets = []
        for tok in tokens:
            offsets.append(self._offset)
            self._offset += len(tok)
        return offsets


def merge_completion_logprobs(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def chat_logprobs(
    strings: TokenStrings,
    token_ids: Sequence[int],
    token_logprobs: Sequence[float],
    top: Sequence[Sequence[tuple[int, float]]],
) -> dict[str, Any]:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for i, tid in enumerate(token_ids):
        pairs = top[i] if i < len(top) else []
        content.append(
            {
                "token": strings.text(tid),
                "logprob": token_logprobs[i] if i < len(token_logprobs) else None,
                "bytes": strings.raw_bytes(tid),
                "top_logprobs": [
                    {"token": strings.text(t), "logprob": lp, "bytes": strings.raw_bytes(t)} for t, lp in pairs
                ],
            }
        )
    return {"content": content}


def completion_body(
    cid: str, created: int, model: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage
    return body


def completion_choice(
    index: int,
    text: str,
    logprobs: dict[str, Any] | None,
    finish: str | None,
    prompt_logprobs: list[Any] | None = None,
    ids: TokenIds | None = None,
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    """One choice; `prompt_logprobs` and the token ids (vLLM's fields) only when the request
    asked for them; vLLM's `stop_reason` with the finish."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": client_finish_reason(finish)}
    if finish is not None:
        choice["stop_reason"] = stop_reason
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    if ids is not None:
        if ids.prompt is not None:
            choice["prompt_token_ids"] = ids.prompt
        choice["token_ids"] = ids.output
    return choice


def chat_body(
    cid: str, created: int, model: str, choices: list[dict[str, Any]], usage: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def chat_choice(
    index: int,
    message: dict[str, Any],
    logprobs: dict[str, Any] | None,
    finish: str | None,
    token_ids: list[int] | None = None,
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    """One choice; `token_ids` (vLLM's field) only when the request asked for them."""
    choice = {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": client_finish_reason(finish),
        "stop_reason": stop_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_chunk(
    cid: str,
    created: int,
    model: str,
    index: int,
    delta: dict[str, Any],
    finish: str | None = None,
    logprobs: dict[str, Any] | None = None,
    with_usage_field: bool = False,
    ids: TokenIds | None = None,
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    """`ids`: vLLM's `return_token_ids`: the choice's ids since its previous chunk, and the
    prompt's at the top level (the first chunk); vLLM's `stop_reason` with the finish."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": client_finish_reason(finish)}
    if finish is not None:
        choice["stop_reason"] = stop_reason
    chunk: dict[str, Any] = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if ids is not None:
        choice["token_ids"] = ids.output
        if ids.prompt is not None:
            chunk["prompt_token_ids"] = ids.prompt
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def usage_chunk(cid: str, created: int, model: str, obj: str, usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": cid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}

"""Prompt logprobs (trident/wire/logprobs.py) in each API's shape.

- echo with logprobs on /v1/completions: OpenAI's legacy `logprobs` object over the prompt
  (`openai_format.CompletionLogprobs.prompt_part`, which takes `echo_entries`);
- vLLM's `prompt_logprobs`: per prompt position a {token id: {logprob, rank,
  decoded_token}} map of the prompt token and the top ones, null where none is computed;
- SGLang's `input_token_logprobs` / `input_top_logprobs` ([logprob, token id, text]), with
  the output's logprobs beside them (`LogprobMeta`: /generate's meta_info, the offline Engine).

Position 0 has no logprob in any of them (nothing precedes it), as in OpenAI, vLLM and SGLang.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokenizer_proc.protocol import NativeLogprobs
from tokenizer_proc.tokenization import TokenStrings
from trident.wire.logprobs import PromptLogprobs

if TYPE_CHECKING:
    from tokenizer_proc.serving import ChoiceResult


def _at(scored: PromptLogprobs | None, position: int) -> int | None:
    """Index of `position` in `scored`, or None when it has no logprob."""
    if scored is None or not scored.start <= position < scored.start + len(scored):
        return None
    return position - scored.start


def _top(scored: PromptLogprobs, i: int, k: int | None = None) -> list[tuple[int, float]]:
    """The top k (all: None) of position index i."""
    return scored.top[i][:k] if scored.top else []


def echo_entries(
    strings: TokenStrings, prompt_ids: Sequence[int], scored: PromptLogprobs | None, k: int
) -> tuple[list[float | None], list[dict[str, float] | None]]:
    """(token_logprobs, top_logprobs) of the echoed prompt: each scored position's own token
    with its top k, as vLLM echoes them; None where no logprob is computed."""
    logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for position, token in enumerate(prompt_ids):
        i = _at(scored, position)
        if i is None:
            logprobs.append(None)
            tops.append(None)
            continue
        lp = scored.token_logprobs[i]
        logprobs.append(lp)
        top = {strings.text(t): v for t, v in _top(scored, i, k)}
        tops.append({strings.text(token): lp, **top})
    return logprobs, tops


def vllm_prompt_logprobs(
    strings: TokenStrings, prompt_ids: Sequence[int], scored: PromptLogprobs | None, k: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` list, one entry per prompt token."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for position, token in enumerate(prompt_ids):
        i = _at(scored, position)
        if i is None:
            out.append(None)
            continue
        entry = {
            str(token): {
                "logprob": scored.token_logprobs[i],
                "rank": scored.ranks[i],
                "decoded_token": strings.text(token),
            }
        }
        for rank, (t, v) in enumerate(_top(scored, i, k), start=1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": strings.text(t)})
        out.append(entry)
    return out


def sglang_entry(strings: TokenStrings | None, token: int, logprob: float | None) -> list[Any]:
    """[logprob, token id, text or None] (the text only with return_text_in_logprobs)."""
    return [logprob, token, strings.text(token) if strings is not None else None]


def sglang_input_logprobs(
    strings: TokenStrings | None, prompt_ids: Sequence[int], scored: PromptLogprobs | None, start: int
) -> tuple[list[list[Any]], list[list[list[Any]] | None]]:
    """SGLang's (input_token_logprobs, input_top_logprobs) from prompt position `start` on."""
    tokens: list[list[Any]] = []
    tops: list[list[list[Any]] | None] = []
    for position in range(start, len(prompt_ids)):
        i = _at(scored, position)
        token = prompt_ids[position]
        tokens.append(sglang_entry(strings, token, None if i is None else scored.token_logprobs[i]))
        tops.append(None if i is None else [sglang_entry(strings, t, v) for t, v in _top(scored, i)])
    return tokens, tops


class LogprobMeta:
    """SGLang's logprob fields of meta_info, for a request with `return_logprob`."""

    def __init__(self, body: NativeLogprobs, strings: TokenStrings, prompt_ids: list[int]) -> None:
        self.strings = strings if body.return_text_in_logprobs else None
        self.prompt_ids = prompt_ids
        self.start = body.logprob_start_len

    def fields(self, r: ChoiceResult) -> dict[str, Any]:
        out: dict[str, Any] = {
            "output_token_logprobs": [
                sglang_entry(self.strings, t, lp) for t, lp in zip(r.token_ids, r.token_logprobs)
            ],
            "output_top_logprobs": [[sglang_entry(self.strings, t, lp) for t, lp in top] for top in r.top_logprobs],
        }
        if self.start >= 0:
            tokens, tops = sglang_input_logprobs(self.strings, self.prompt_ids, r.prompt_logprobs, self.start)
            out["input_token_logprobs"], out["input_top_logprobs"] = tokens, tops
        return out

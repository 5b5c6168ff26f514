"""Prompt logprobs: how well the model predicted each prompt token, as they cross processes.

The worker scores prompt tokens from the logits its prefill computes anyway (one
`PromptLogprobs` per prompt chunk that asks, in `StepResult.prompt_logprobs`); the
scheduler joins a request's chunks into one and sends it with the request's first output
(`RowExtras.prompt_logprobs`); the tokenizer writes it in each API's shape (echo with
logprobs, vLLM's `prompt_logprobs`, SGLang's `input_token_logprobs`).
"""

from __future__ import annotations

import msgspec


class PromptLogprobs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Consecutive prompt positions `start`, `start + 1`, ...: for each, the log-probability
    (float32 log_softmax of the raw logits: no temperature, penalty or bias) of the prompt
    token there, given the tokens before it. Position 0 is never scored: nothing precedes it."""

    start: int
    """Prompt position of the first entry."""
    token_logprobs: list[float] = []
    """The prompt token's logprob, one per position."""
    ranks: list[int] = []
    """The prompt token's rank in its position's distribution (1: the most likely)."""
    top: list[list[tuple[int, float]]] = []
    """Per position, the top (token id, logprob) pairs, most likely first; empty lists when
    the request asked for no top logprobs."""

    def __len__(self) -> int:
        return len(self.token_logprobs)

    def __post_init__(self) -> None:
        """Runs on decode too: columns that disagree make the frame fail to decode."""
        if len(self.ranks) != len(self.token_logprobs) or (self.top and len(self.top) != len(self.token_logprobs)):
            raise ValueError("prompt logprob columns differ in length")

    def extended(self, more: PromptLogprobs) -> PromptLogprobs:
        """These positions followed by `more`'s, which must start where these end."""
        if more.start != self.start + len(self):
            raise ValueError(f"prompt logprobs from {more.start} do not follow {self.start}..{self.start + len(self)}")
        top = self.top + more.top if self.top or more.top else []
        return PromptLogprobs(self.start, self.token_logprobs + more.token_logprobs, self.ranks + more.ranks, top)

"""One request as the scheduler sees it: tokens, KV pages held, progress, finish state."""

from __future__ import annotations

import enum
import time

import numpy as np

from trident.wire.frontend import SamplingParams
from trident.wire.logprobs import PromptLogprobs


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class Req:
    """Owned by the scheduler from GenerateReq until its last TokenOutBatch row.

    KV of a running request (page_size 4, 10 tokens computed, 2 more in this step):

        fill_ids   [p p p p p p p p o o|o o]     p: prompt, o: outputs before a resume
        pages      [ page a | page b | page c ]  held: one reference each
                   ^-prefix_len (from cache)^    ^ seq_len (ScheduleBatch's mirror): KV written
    """

    # A decode step touches several of these per running request: slots make that cheaper.
    __slots__ = (
        "arrival_time",
        "cache_salt",
        "cached_tokens",
        "decoding",
        "embedding",
        "error",
        "fill_ids",
        "finish_reason",
        "max_output_len",
        "num_retractions",
        "output_ids",
        "pages",
        "pages_sent",
        "pending_results",
        "prefill_only",
        "prefix_len",
        "priority",
        "prompt_ids",
        "prompt_logprobs",
        "prompt_logprobs_sent",
        "resumed_ids",
        "rid",
        "sampling",
        "slot",
        "stop_ids",
    )

    def __init__(
        self,
        rid: str,
        prompt_ids: np.ndarray,
        sampling: SamplingParams,
        eos_ids: frozenset[int] = frozenset(),
        context_length: int = 1 << 62,
        resumed_ids: list[int] | None = None,
        embedding: bool = False,
        cache_salt: str = "",
        priority: int = 0,
    ) -> None:
        self.rid = rid
        self.cache_salt = cache_salt
        """Which of the prefix cache's trees it reads and writes (`GenerateReq.cache_salt`)."""
        self.priority = priority
        """`GenerateReq.priority`: lower is admitted first and retracted last."""
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.resumed_ids: list[int] = resumed_ids or []
        """Outputs from before a scheduler restart (the end of prompt_ids); the worker's
        grammar matcher re-advances over them with the row's later outputs."""
        self.output_ids: list[int] = []
        self.stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else eos_ids)
        """Tokens that end the request once it has min_new_tokens (the model's EOS ids
        unless ignore_eos, plus its own stop ids)."""
        self.max_output_len = max(1, min(sampling.max_new_tokens, context_length - len(prompt_ids)))
        """Outputs at which it ends with "length" (its budget, or the context is full; at
        least the one token every sampling row gets)."""
        self.arrival_time = time.monotonic()
        self.embedding = embedding
        """An `EmbedReq`: the worker pools its prompt's final hidden states and samples
        nothing; the pooled vector is its one output."""
        self.prefill_only = embedding or sampling.max_new_tokens == 0
        """Its prefill is all it runs: it ends with the result of the step that runs its last
        prompt chunk, and leaves the batch before any decode step. Two kinds: an embedding request (its vector) and a
        max_tokens 0 request, which scores its prompt (its prompt logprobs go out with the
        token the worker samples after the prompt, as for any row; output.py drops that
        token)."""

        # KV state, valid while the request is in the running batch
        self.slot: int | None = None
        self.pages: list[int] = []
        self.prefix_len = 0
        """Tokens matched in the prefix cache at admission."""
        self.fill_ids: np.ndarray = prompt_ids
        """What must be prefilled: the prompt, plus earlier outputs after a retraction."""
        self.decoding = False
        """Prefill done: each step runs one token."""
        self.pages_sent = 0
        """How many of `pages` the worker's page table already holds."""

        self.prompt_logprobs: PromptLogprobs | None = None
        """Prompt logprobs of the chunks run so far, until they go out with the first output."""
        self.prompt_logprobs_sent = False
        self.cached_tokens = 0
        """Prompt tokens served from the prefix cache (first admission only)."""
        self.finish_reason: FinishReason | None = None
        self.error = ""
        self.num_retractions = 0
        self.pending_results = 0
        """Steps in flight that will sample a token for this request (overlap: up to 2).
        A retracted request is not re-admitted until they are processed."""

    def reset_kv_state(self) -> None:
        """The worker group that held this request's KV is gone: start over from the queue."""
        self.slot = None
        self.pages = []
        self.pages_sent = 0
        self.prefix_len = 0
        self.decoding = False
        self.pending_results = 0
        self.num_retractions += 1
        self.prompt_logprobs = None  # the resumed prefill scores the prompt again

    def score_start(self) -> int:
        """The first prompt position this request still scores (prompt logprobs); -1: none."""
        if self.sampling.prompt_logprobs_from < 0 or self.prompt_logprobs_sent:
            return -1
        return max(1, self.sampling.prompt_logprobs_from)

    def reusable_prefix(self) -> int:
        """Tokens of cached prefix it may take: up to the position before its first scored
        one, whose logits score that one (prompt_logprobs.py); else any."""
        first = self.score_start()
        return len(self.fill_ids) if first < 0 else first - 1

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        """What goes out with the first output, once: the prompt logprobs it asked for (an
        empty list when its prompt has no position from its start on), else None."""
        first = self.score_start()
        if first < 0:
            return None
        self.prompt_logprobs_sent = True
        scored, self.prompt_logprobs = self.prompt_logprobs, None
        return scored if scored is not None else PromptLogprobs(first)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def all_token_ids(self) -> np.ndarray:
        if not self.output_ids:
            return self.prompt_ids
        return np.concatenate([self.prompt_ids, np.asarray(self.output_ids, dtype=np.int32)])

    def remaining_new_tokens(self) -> int:
        return self.sampling.max_new_tokens - len(self.output_ids)

    def ends_with_steps_in_flight(self) -> bool:
        """Its output budget runs out with the tokens of the steps already sent (each adds
        at least one): no later step can add to it. With overlap, the next step is built
        before those results arrive; without this, it would carry the row one step past
        its finish, a whole forward for a one-token request before its answer goes out.
        A `prefill_only` request ends with the result of its last prompt chunk."""
        if self.prefill_only:
            return self.pending_results > 0
        return len(self.output_ids) + self.pending_results >= self.max_output_len

    def finish(self, reason: FinishReason, error: str = "") -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.error = error

"""Messages between the tokenizer process and the scheduler process.

tokenizer -> scheduler: `SchedulerInput` (hello, generate, abort, flush).
scheduler -> tokenizer: `TokenizerInput` (per-step batched token outputs, periodic stats).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec
import numpy as np

from trident.wire.logprobs import PromptLogprobs


class GrammarSpec(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """A decoding constraint as the client gave it, not compiled: written by the tokenizer
    (or the offline Engine) after parsing it once to reject bad input; compiled against the
    vocabulary by the worker, which owns the matcher (gpu_worker/runtime/grammar.py)."""

    kind: str
    """json_schema | regex | ebnf."""
    text: str
    """The JSON schema (as JSON text), the regular expression, or the EBNF grammar (GBNF
    style, with a `root` rule)."""
    strict: bool = True
    """json_schema only: OpenAI's `strict`. True: properties not listed are refused even
    where the schema leaves `additionalProperties` unset; False: the schema as written."""


INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class ClientRange:
    """The values a client may give a `SamplingParams` knob, beside its type (`Annotated`).
    The tokenizer's request models refuse anything outside it with a 400
    (tokenizer_proc/protocol.py builds them from these fields); msgspec ignores it, so the
    wire carries what the tokenizer resolved without checking it again."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True):
    """Per-request sampling, validated by the tokenizer, applied by the worker.

    The one list of sampling fields: each is declared here once, with its default and the
    range a client may give it. The HTTP request models (OpenAI routes, /generate, the
    offline Engine) take every field by its name here, with this default and range, except
    those the tokenizer resolves from each endpoint's own fields
    (`tokenizer_proc.protocol.RESOLVED_FIELDS`); the OpenAI routes rename a few
    (`tokenizer_proc.protocol.OPENAI_NAMES`). The field order is the wire format: append only.
    """

    max_new_tokens: int
    """Resolved by the tokenizer: the request's max_tokens, or the rest of the context."""
    temperature: Annotated[float, ClientRange(ge=0.0, le=2.0)] = 1.0
    """0 means greedy. 1 is the default of the OpenAI API (and of vLLM and SGLang): sample
    from the model's distribution as it is."""
    top_p: Annotated[float, ClientRange(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, ClientRange(ge=-1, le=INT32_MAX)] = -1
    """-1 means the whole vocabulary."""
    min_p: Annotated[float, ClientRange(ge=0.0, le=1.0)] = 0.0
    frequency_penalty: Annotated[float, ClientRange(ge=-2.0, le=2.0)] = 0.0
    presence_penalty: Annotated[float, ClientRange(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, ClientRange(gt=0.0, le=2.0)] = 1.0
    seed: Annotated[int | None, ClientRange(ge=-INT64_MAX, le=INT64_MAX)] = None
    """Same seed, same tokens, whatever else shares the batch."""
    min_new_tokens: Annotated[int, ClientRange(ge=0, le=INT32_MAX)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    """Extra token ids that end the request (the model's EOS ids are always included)."""
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: list[tuple[int, float]] = []
    """(token id, bias) pairs added to the logits before sampling (OpenAI's `logit_bias`,
    bias in [-100, 100]); pairs rather than a map so that plain msgpack decodes the frame."""
    grammar: GrammarSpec | None = None
    """The constraint every sampled token must keep (structured outputs, forced tool
    calls); None: unconstrained. Travels with the request, so a resumed request has it."""
    prompt_logprobs_from: int = -1
    """Resolved by the tokenizer: the first prompt position whose token's logprob the request
    returns (echo with logprobs, vLLM's prompt_logprobs, SGLang's logprob_start_len); -1:
    none. Position 0 is never scored (nothing precedes it), so scoring starts at max(1, this).
    The scheduler reuses no cached prefix past the position before it (scheduler_proc/prefill.py)."""
    prompt_top_logprobs: int = 0
    """Top logprobs returned per scored prompt position."""
    allowed_token_ids: list[int] = []
    """vLLM's: the only tokens the request may sample (after logit_bias); empty: every token."""
    bad_words_ids: list[list[int]] = []
    """Resolved by the tokenizer from vLLM's `bad_words`: token sequences the output must not
    contain. The last token of each is banned wherever the output so far ends with the rest."""

    def named_token_ids(self) -> list[int]:
        """Every token id these parameters name (stop, biased, allowed, banned): the worker
        checks them against its vocabulary before it indexes logits with them."""
        return [
            *self.stop_token_ids,
            *(t for t, _ in self.logit_bias),
            *self.allowed_token_ids,
            *(t for word in self.bad_words_ids for t in word),
        ]

    def drafts_allowed(self) -> bool:
        """Speculative drafts are verified by exact argmax match of the raw logits, so only
        plain greedy requests draft: a grammar mask, a logit bias, allowed or banned tokens
        would change the argmax the draft is checked against, and such rows are left out of
        drafting. The scheduler (KV reservation) and the worker (drafting) agree on it."""
        return (
            self.temperature <= 0.0
            and self.frequency_penalty == 0.0
            and self.presence_penalty == 0.0
            and self.repetition_penalty == 1.0
            and self.min_new_tokens == 0
            and not self.logprobs
            and not self.logit_bias
            and not self.allowed_token_ids
            and not self.bad_words_ids
            and self.grammar is None
        )


class TokenizerHello(msgspec.Struct, array_like=True, tag="hello"):
    """First frame the tokenizer sends; the scheduler checks the version."""

    protocol_version: int
    pid: int


class GenerateReq(msgspec.Struct, array_like=True, tag="generate"):
    """A tokenized request. Written by the tokenizer, owned by the scheduler from then on."""

    rid: str
    input_ids: bytes
    """Prompt token ids, raw little-endian int32."""
    sampling: SamplingParams
    resumed_ids: bytes = b""
    """int32 tokens the request produced before its scheduler was lost, which end
    `input_ids`: written by the tokenizer when it resubmits, passed to the worker with the
    row (`AddedRequest.generated_ids`) so that its grammar matcher re-advances over them."""
    scheduler_boot_id: str = ""
    """The `ServerInfo.boot_id` of the scheduler the tokenizer meant this for (its latest).
    A request sent while that scheduler was dead waits in the socket and reaches its
    successor, to which the tokenizer also resubmits every open request once it sees the
    successor's ServerInfo: the scheduler drops one addressed to another boot, so each runs
    once. Empty: any scheduler (tools that drive a scheduler directly)."""
    cache_salt: str = ""
    """The client's `cache_salt`: the scheduler's prefix cache gives this request only what
    requests of the same salt cached (scheduler_proc/radix_cache.py); empty: the shared cache."""
    priority: int = 0
    """The client's `priority` under `--schedule-policy priority`: lower is admitted first (ties
    by arrival) and retracted last. The tokenizer refuses non-zero under other policies."""


class EmbedReq(msgspec.Struct, array_like=True, tag="embed"):
    """A tokenized /v1/embeddings input. Written by the tokenizer, owned by the scheduler from
    then on. It runs as a prefill that samples nothing: the worker pools the final hidden
    states of its prompt (`--pooling`) and its one output row carries the vector
    (`RowExtras.embedding`)."""

    rid: str
    input_ids: bytes
    """Token ids, raw little-endian int32."""
    scheduler_boot_id: str = ""
    """As `GenerateReq.scheduler_boot_id`: a scheduler drops one addressed to another boot."""


class AbortReq(msgspec.Struct, array_like=True, tag="abort"):
    """Stop a request (client gone, stop string hit, /abort); the scheduler frees its KV."""

    rid: str


class FlushCacheReq(msgspec.Struct, array_like=True, tag="flush"):
    """Empty the radix prefix cache when no request is running."""


class WorkerGroupLost(msgspec.Struct, array_like=True, tag="worker_group_lost"):
    """From launch.py: the worker ranks died and are being restarted; requeue what ran."""

    reason: str
    generation: int
    """The generation of the group that was lost (WorkerReady.generation). Written by
    launch.py; a scheduler already connected to a later group ignores the message."""


SchedulerInput = TokenizerHello | GenerateReq | EmbedReq | AbortReq | FlushCacheReq | WorkerGroupLost


class RowExtras(msgspec.Struct, array_like=True, omit_defaults=True):
    """The rarely set fields of one `TokenOutBatch` row. Written by the scheduler only for a
    row that has one of them (its first output, its last, logprobs); steady decode rows have
    none, so a decode step costs no per-row struct on either side."""

    row: int
    """Index of the row in the batch's `rids`."""
    finish_reason: str | None = None
    """stop | length | abort | error; None while the request runs."""
    error: str = ""
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (sent with the first output)."""
    token_logprobs: list[float] = []
    """Log-probability of each of the row's new tokens (when requested)."""
    top_logprobs: list[list[tuple[int, float]]] = []
    """Per new token, the top (token id, logprob) pairs (when requested)."""
    embedding: bytes = b""
    """An embedding request's pooled, L2-normalized vector, little-endian float32: its only
    output, sent with its finish (the worker's `StepResult.embeddings`)."""
    prompt_logprobs: PromptLogprobs | None = None
    """Every prompt logprob the request asked for, sent once, with its first output."""


class TokenOutBatch(msgspec.Struct, array_like=True, omit_defaults=True, tag="tokens"):
    """What the requests of one scheduler step produced, column-wise, as one frame.

    Written by the scheduler (`scheduler_proc/output.py`), read by the tokenizer's receive
    task through `rows()`. Row i is request `rids[i]`; its new tokens (since its previous
    row) are the next `counts[i]` ids of `token_ids`. A decode step's token ids are the
    worker's `StepResult.next_token_ids` bytes passed through when no row was dropped.
    """

    rids: list[str]
    token_ids: bytes = b""
    """int32 new tokens of every row, back to back, in row order."""
    token_counts: bytes = b""
    """int32 number of new tokens per row; empty means one per row."""
    extras: list[RowExtras] = []
    """Rows with a finish, an error, cached tokens or logprobs, in row order."""

    def __post_init__(self) -> None:
        """Runs on decode too: a frame whose columns disagree fails to decode, and is
        dropped and counted like any malformed frame (wire/codec.py)."""
        n_tokens, odd = divmod(len(self.token_ids), 4)
        if self.token_counts:
            counts = np.frombuffer(self.token_counts, dtype="<i4") if len(self.token_counts) % 4 == 0 else None
            if counts is None or len(counts) != len(self.rids) or (counts < 0).any() or counts.sum() != n_tokens:
                raise ValueError(f"token_counts do not split the tokens over {len(self.rids)} rows")
        elif n_tokens != len(self.rids):
            raise ValueError(f"{n_tokens} token ids for {len(self.rids)} rows of one token each")
        if odd:
            raise ValueError("token_ids is not int32")
        if any(not 0 <= e.row < len(self.rids) for e in self.extras):
            raise ValueError(f"extras name a row outside 0..{len(self.rids) - 1}")

    def rows(self) -> Iterator[tuple[str, list[int], RowExtras | None]]:
        """(rid, new token ids, extras or None) for each row, in order."""
        tokens = np.frombuffer(self.token_ids, dtype="<i4").tolist()
        if self.token_counts:
            ends = np.cumsum(np.frombuffer(self.token_counts, dtype="<i4")).tolist()
            per_row = [tokens[start:end] for start, end in zip([0, *ends], ends)]
        else:
            per_row = [[t] for t in tokens]
        extras: list[RowExtras | None] = [None] * len(self.rids)
        for e in self.extras:
            extras[e.row] = e
        return zip(self.rids, per_row, extras)


@dataclass(frozen=True)
class Stat:
    """What a `SchedulerStats` field means to a reader of /metrics, beside its type
    (`Annotated`): the tokenizer exports each field that has one as `trident_<metric>`
    (tokenizer_proc/metrics.py), and merges the data-parallel replicas' by `merge`."""

    kind: Literal["counter", "gauge"]
    help: str
    metric: str = ""
    """The Prometheus name after `trident_`, where it is not the field's name."""
    merge: Literal["sum", "max"] = "sum"
    """How replicas combine: totals add up; a value about one step takes the largest."""


class SchedulerStats(msgspec.Struct, array_like=True, tag="stats"):
    """Periodic snapshot from the scheduler, for /metrics and /server_info: the one
    definition of each scheduler counter (its kind and help text in its `Stat`).

    Written by the scheduler (scheduler_proc/stats.py: what it counts itself it keeps in a
    `SchedulerStats`, the rest it reads when it publishes); mirrored by the tokenizer."""

    running_requests: Annotated[int, Stat("gauge", "Requests in the running batch.", "num_requests_running")] = 0
    queued_requests: Annotated[int, Stat("gauge", "Requests queued in the scheduler.", "num_requests_waiting")] = 0
    kv_used_tokens: Annotated[int, Stat("gauge", "KV token slots in use.", "kv_cache_used_tokens")] = 0
    kv_total_tokens: Annotated[int, Stat("gauge", "KV token slots in all.", "kv_cache_total_tokens")] = 0
    cache_hit_tokens: Annotated[
        int,
        Stat(
            "gauge",
            "Prompt tokens of the running requests whose KV came from the prefix cache.",
            "running_cache_hit_tokens",
        ),
    ] = 0
    prompt_tokens: Annotated[
        int, Stat("counter", "Prompt tokens of the requests the scheduler admitted.", "scheduler_prompt_tokens")
    ] = 0
    generation_tokens: Annotated[
        int, Stat("counter", "Tokens the scheduler's steps generated.", "scheduler_generation_tokens")
    ] = 0
    steps: Annotated[int, Stat("counter", "Scheduler steps.", "scheduler_steps")] = 0
    last_step_time_s: Annotated[
        float,
        Stat("gauge", "Send-to-result time of the scheduler's latest step.", "step_time_seconds", merge="max"),
    ] = 0.0
    prefill_tokens_computed: Annotated[int, Stat("counter", "Prompt tokens run through the model.")] = 0
    """Counted by the worker."""
    seq_lens_d2h_copies: Annotated[int, Stat("counter", "Device-to-host copies of seq_lens by the worker.")] = 0
    """Counted by the worker."""
    dropped_frames: Annotated[int, Stat("counter", "Malformed frames dropped (tokenizer + scheduler).")] = 0
    """The scheduler's and its workers' (frames they could not decode, descriptors refused,
    stale or forged replies); the tokenizer adds its own before it exports them."""
    retractions: Annotated[int, Stat("counter", "Requests retracted for lack of KV.")] = 0
    worker_busy_s: Annotated[float, Stat("counter", "Worker time spent running steps.", "worker_busy_seconds")] = 0.0
    worker_idle_s: Annotated[
        float,
        Stat("counter", "Worker time waiting for a descriptor while it had running rows.", "worker_idle_seconds"),
    ] = 0.0
    worker_cpu_s: Annotated[
        float, Stat("counter", "Worker CPU time (all threads) spent running steps.", "worker_cpu_seconds")
    ] = 0.0
    descriptor_bytes: Annotated[int, Stat("gauge", "Size of the last descriptor sent.", merge="max")] = 0
    overlapped_steps: Annotated[int, Stat("counter", "Steps sent on the overlapped path.")] = 0
    """Each must cost the worker one seq_lens copy."""
    resumed_requests: Annotated[
        int,
        Stat("counter", "Requests put back as prefills after a worker group was lost.", "scheduler_resumed_requests"),
    ] = 0
    spec_verify_rows: Annotated[
        int, Stat("counter", "Decode row-steps run with speculation on (a row without a draft counts).")
    ] = 0
    spec_accepted_drafts: Annotated[int, Stat("counter", "Draft tokens accepted over those row-steps.")] = 0
    """Mean accepted length = 1 + this / spec_verify_rows."""
    rejected_frames: Annotated[
        int, Stat("counter", "Frames with a bad HMAC tag on the schedulers' cross-node ports.")
    ] = 0
    dp_rank: int = 0
    """The data-parallel replica whose scheduler sent this (a label, not a statistic)."""


SCHEDULER_STATS: dict[str, Stat] = {
    f.name: meta
    for f in msgspec.structs.fields(SchedulerStats)
    for meta in getattr(f.type, "__metadata__", ())
    if isinstance(meta, Stat)
}
"""Each statistic of `SchedulerStats` by field name, in field order."""


class FlushCacheDone(msgspec.Struct, array_like=True, tag="flushed"):
    ok: bool
    message: str = ""
    dp_rank: int = 0


class ServerInfo(msgspec.Struct, array_like=True, tag="server_info"):
    """Sent by the scheduler when it starts and in answer to TokenizerHello: what the
    tokenizer validates against. A new boot_id tells the tokenizer the scheduler restarted."""

    protocol_version: int
    context_length: int
    """Longest prompt + output a request may have."""
    vocab_size: int
    max_running_requests: int
    kv_total_tokens: int
    eos_token_ids: list[int]
    boot_id: str = ""
    """Unique per scheduler start."""
    dp_rank: int = 0
    """The data-parallel replica this scheduler serves."""


class ServerHealth(msgspec.Struct, array_like=True, tag="health"):
    """From launch.py after each restart: counts for /metrics, and whether to keep serving."""

    healthy: bool
    restarts: int
    """Restarts of any process since launch."""
    last_cause: str = ""
    resumed_requests: int = 0
    """Requests the last restart put back as prefills."""
    rank_nodes: list[list[str]] = []
    """With --distributed-executor ray: rank_nodes[d][r] names the Ray node that holds rank r
    of replica d (empty while the group is not placed)."""


TokenizerInput = ServerInfo | TokenOutBatch | SchedulerStats | FlushCacheDone | ServerHealth

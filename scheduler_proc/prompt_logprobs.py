"""Prompt logprobs, the scheduler's part: which positions each chunk scores, and each
request's scores joined until they go out with its first output (trident/wire/logprobs.py).

A request that wants prompt logprobs from position s needs the logits of positions
s-1 .. P-2 of its P-token prompt, and only a position that runs has logits: it takes no
cached prefix past s-1 (`Req.reusable_prefix`), and each chunk scores the positions of
those it runs. A request whose scores went out never scores again, whatever it runs later
(a resume after a worker loss, a re-admission after a retraction); one that lost its worker
group before they went out drops what it had and scores its prompt again from the start,
so the client gets each position exactly once.
"""

from __future__ import annotations

from scheduler_proc.request import Req
from trident.wire.backend import ExtendChunk, StepResult
from trident.wire.codec import pack_int32


def chunk_scoring(req: Req, start: int, n: int) -> tuple[int, bytes]:
    """(score_from, score_targets) of `req`'s chunk of positions start .. start+n-1:
    (-1, b"") when it scores nothing."""
    first = req.score_start()
    if first < 0:
        return -1, b""
    last = min(len(req.prompt_ids) - 2, start + n - 1)
    begin = max(first - 1, start)
    if begin > last:
        return -1, b""
    return begin - start, pack_int32(req.fill_ids[begin + 1 : last + 2])


def scoring_mismatch(extends: list[ExtendChunk], result: StepResult) -> str | None:
    """Why the result's prompt logprobs cannot be those of the step's scoring chunks."""
    wanted = [len(c.score_targets) // 4 for c in extends if c.score_targets]
    got = [len(lp) for lp in result.prompt_logprobs]
    if wanted != got:
        return f"prompt logprobs for {got} positions, where the step's chunks score {wanted}"
    return None


def take_prompt_logprobs(reqs: list[Req], result: StepResult) -> None:
    """Adds each scoring chunk's logprobs to its request (in the step's chunk order)."""
    for req, scored in zip(reqs, result.prompt_logprobs, strict=True):
        if req.finished or req.prompt_logprobs_sent:
            continue
        req.prompt_logprobs = scored if req.prompt_logprobs is None else req.prompt_logprobs.extended(scored)

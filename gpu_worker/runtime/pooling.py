"""Embedding rows: the final hidden states of a prompt pooled into one vector (`--pooling`).

An embedding request (wire `EmbedReq`, `AddedRequest.pooled`) runs as a prefill that samples
nothing. Each step that runs chunks of such rows, the worker hands `Pooler.pool` the final
hidden states (after the model's final norm) of the flat positions `Pooler.positions` names;
the vector of each row whose last chunk ran is L2-normalized in float32 and leaves with the
step's result (`StepResult.embeddings`, through `Pooler.take`).

- last: the last token's state, read in the step that runs the last chunk. A causal model's
  last token is the only one that has seen the whole input (Qwen3-Embedding, e5-mistral).
- mean: the mean over every token of the prompt. A chunked prompt adds each chunk's sum to
  its slot's running sum, in float32. The scheduler gives such a row no cached prefix (those
  tokens have no hidden states here), so its first chunk starts at position 0.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from gpu_worker.runtime.batch_state import StepPlan
from trident.wire.backend import Embeddings

POOLING_MODES = ("last", "mean")


class PoolingOutOfStep(RuntimeError):
    """A mean-pooled row's chunk does not continue the tokens its sum holds."""


class Pooler:
    """Owns the running sums of mean-pooled rows (by slot) and the vectors of the current step."""

    def __init__(self, mode: str, dim: int, max_slots: int, device: torch.device) -> None:
        if mode not in POOLING_MODES:
            raise ValueError(f"--pooling {mode}: expected one of {', '.join(POOLING_MODES)}")
        self.mode = mode
        self.dim = dim
        self.sums = torch.zeros((max_slots, dim), dtype=torch.float32, device=device) if mode == "mean" else None
        """mean: each row's sum of the final hidden states of its tokens so far."""
        self.summed = np.zeros(max_slots, dtype=np.int64)
        """mean: how many tokens each row's sum holds."""
        self._vectors: list[torch.Tensor] = []

    def positions(self, plan: StepPlan) -> np.ndarray:
        """The flat indices whose final hidden states `pool` takes, in the order it takes them."""
        if self.mode == "last":
            return np.asarray([c.offset + c.length - 1 for c in plan.pooled_rows if c.is_last], dtype=np.int64)
        spans = [np.arange(c.offset, c.offset + c.length) for c in plan.pooled_rows]
        return np.concatenate(spans) if spans else np.zeros(0, dtype=np.int64)

    @torch.inference_mode()
    def pool(self, plan: StepPlan, states: torch.Tensor) -> None:
        """Takes the final hidden states of `positions(plan)`: a vector for each row whose
        prompt ends this step, kept for `take`."""
        if self.mode == "last":
            if len(states):
                self._vectors.append(states.float())
            return
        assert self.sums is not None
        at = 0
        for chunk in plan.pooled_rows:
            chunk_sum = states[at : at + chunk.length].float().sum(0)
            at += chunk.length
            if chunk.start == 0:
                self.sums[chunk.slot] = chunk_sum
            elif chunk.start == self.summed[chunk.slot]:
                self.sums[chunk.slot] += chunk_sum
            else:
                raise PoolingOutOfStep(
                    f"slot {chunk.slot}: a chunk at position {chunk.start}, but its mean holds "
                    f"{self.summed[chunk.slot]} tokens (a mean-pooled row took a cached prefix?)"
                )
            self.summed[chunk.slot] = chunk.start + chunk.length
            if chunk.is_last:
                self._vectors.append((self.sums[chunk.slot] / float(self.summed[chunk.slot])).unsqueeze(0))

    def take(self) -> Embeddings | None:
        """The normalized vectors of the rows whose prompt ended since the last call, in batch
        order, as the step result carries them; None when there are none."""
        if not self._vectors:
            return None
        vectors = F.normalize(torch.cat(self._vectors), dim=-1)
        self._vectors = []
        return Embeddings(self.dim, vectors.cpu().numpy().astype("<f4").tobytes())

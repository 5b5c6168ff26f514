"""Prompt logprobs from a prefill's logits (trident/wire/logprobs.py).

The positions a chunk scores get their logits in the same forward as the sampling rows
(batch_state.py puts them after those), so scoring a prompt costs the LM head over its
positions and a log_softmax, never a second forward pass.
"""

from __future__ import annotations

import numpy as np
import torch

from trident.wire.logprobs import PromptLogprobs

ROWS_PER_BLOCK = 256
"""Positions converted to float32 at once: a block's float32 copy of the vocabulary's logits
stays small whatever the chunk size."""


def score_prompt_chunks(logits: torch.Tensor, chunks: list[tuple[int, np.ndarray, int]]) -> list[PromptLogprobs]:
    """logits [sum of targets, vocab] in the model's dtype, the chunks' rows back to back;
    `chunks`: (prompt position of the first target, target token ids, top logprobs wanted)."""
    out, row = [], 0
    for start, targets, k in chunks:
        lps: list[float] = []
        ranks: list[int] = []
        top: list[list[tuple[int, float]]] = []
        for begin in range(0, len(targets), ROWS_PER_BLOCK):
            block_targets = torch.from_numpy(targets[begin : begin + ROWS_PER_BLOCK].astype(np.int64))
            block = logits[row + begin : row + begin + len(block_targets)]
            logprobs = torch.log_softmax(block.float(), dim=-1)
            chosen = logprobs.gather(-1, block_targets.to(logprobs.device)[:, None])
            lps += chosen.squeeze(-1).tolist()
            ranks += ((logprobs > chosen).sum(dim=-1) + 1).tolist()
            if k:
                values, ids = logprobs.topk(k, dim=-1)
                top += [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        row += len(targets)
        out.append(PromptLogprobs(start, lps, ranks, top))
    return out

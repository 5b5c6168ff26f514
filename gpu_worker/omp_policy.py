"""How the worker's OpenMP threads wait, set before torch is imported.

The worker's torch threads take the node's cores, but they are never alone on them: the
scheduler and tokenizer run beside them (and, on a shared machine, everything else). By
default libgomp's threads spin at the end of each parallel region; when one of them is
descheduled, its teammates spin through their whole time slice waiting for it, and every
one of the ~200 parallel regions of a decode step can cost a slice. Sleeping at once
(`OMP_WAIT_POLICY=PASSIVE`) gives the core back to the thread that is late. Measured on
2 shared cores (docs/benchmarks.md): decode steps 2-3.5x faster at batch 1 and 32, with
or without an extra competing process.

A value the user set in the environment wins. libgomp reads it once, when torch loads it,
so it must be set before `import torch`: the worker's entry point does that first thing.
"""

from __future__ import annotations

import os
import sys


def use_passive_omp_wait() -> bool:
    """Sets the default policy; False when torch is already loaded and it is too late."""
    if "torch" in sys.modules:
        return False
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return True

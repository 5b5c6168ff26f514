"""How the worker's OpenMP threads wait, set before torch is imported.

The worker's torch threads take the node's cores, but they are never alone on them: the
scheduler and tokenizer run beside them (and, on a shared machine, everything else). By
default libgomp's threads spin at the end of each parallel region; when one of them is
descheduled, its teammates spin through their whole time slice waiting for it, and every
one of the ~200 parallel regions of a decode step can cost a slice. Sleeping at once
(`OMP_WAIT_POLICY=PASSIVE`) gives the core back to the thread that is late, which made
decode steps several times faster on shared cores at every batch size (docs/benchmarks.md,
"Method").

Sleeping at once costs a futex wake-up per region, though, and a region's teammate is
usually back within microseconds. So a thread first spins briefly (`GOMP_SPINCOUNT` =
10,000 spins, a fraction of a millisecond), then sleeps: that keeps the wake-up off the
common path and still yields the core to a late thread (docs/benchmarks.md has the A/B
against sleeping at once). libgomp takes an explicit
GOMP_SPINCOUNT over the policy's own count.

A value the user set in the environment wins (either variable: a user's OMP_WAIT_POLICY
keeps its own spin count). libgomp reads them once, when torch loads it, so they must be
set before `import torch`: the worker's entry point does that first thing.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = "10000"


def use_passive_omp_wait() -> bool:
    """Sets the default policy (a brief spin, then sleep); False when torch is already
    loaded and it is too late."""
    if "torch" in sys.modules:
        return False
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return True

"""The worker's heap keeps freed memory (gpu_worker/runtime/malloc_policy.py): a large temporary
freed and allocated again reuses pages already faulted in, where glibc's defaults map
and unmap it every time and pay a page fault per 4 KB again."""

from __future__ import annotations

import subprocess
import sys

BLOCK_MB = 40  # above glibc's largest mmap threshold (32 MB): always mapped under its defaults
ROUNDS = 8

CHILD = f"""
import ctypes, resource, sys
from gpu_worker.runtime.malloc_policy import keep_freed_memory
print(keep_freed_memory() if sys.argv[1] == "keep" else True)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = {BLOCK_MB} << 20
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({ROUNDS}):
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)  # first touch, as a tensor's kernel writing its output
    libc.free(block)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(policy: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, policy], capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    assert applied == "True"
    return int(faults)


def test_a_freed_large_temporary_is_reused_without_new_page_faults():
    pages_per_block = (BLOCK_MB << 20) // 4096
    default_faults, kept_faults = _page_faults("glibc"), _page_faults("keep")
    assert default_faults >= ROUNDS * pages_per_block * 0.9  # every round faults the block in again
    assert kept_faults <= 1.5 * pages_per_block  # only the first round does

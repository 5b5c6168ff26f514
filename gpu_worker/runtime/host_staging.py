"""The host side of a step's host-device copies: persistent buffers, non-blocking copies.

`StepStaging` carries a step's small metadata arrays (positions, pool indices, lengths,
sampling parameters) to the device. Each array is written into a persistent host buffer
of its dtype, and `flush` sends everything staged since the last flush in one
non-blocking copy per dtype into a persistent device buffer, whose slices the model reads.
On CUDA the host buffers are pinned: a copy from pageable memory is synchronous, and one
per field per step would stall the host 10-30 times a step. On CPU the device buffer is
the host buffer itself, so staging is a memcpy and `flush` copies nothing; the same code
runs, and is tested, on both.

`DeviceToHost` is the other direction: a non-blocking copy into a pinned buffer, then one
wait on an event recorded after it (on CPU, a plain copy and no wait).

A host buffer is rewritten only after the copies that read it have completed
(`begin_step` waits on the last flush's event; by then the step's sampled tokens have been
read back, so the wait costs nothing). A view is a contiguous slice of a flat buffer, so a
[rows, n] view has the strides of any other [rows, n] tensor (compiled decode graphs are
specialised on strides). A buffer too small for a step is replaced by one twice as large;
the views already handed out keep the old one alive until it has been flushed.

`reserve` lays out inputs at fixed device addresses (what a captured CUDA graph reads, the
decode-graph runner's): one more host buffer and device twin per dtype, sized once, never
regrown; `stage_fixed` writes a field and `flush` copies the span written since the last flush
in the same one copy per dtype.
"""

from __future__ import annotations

import numpy as np
import torch

INITIAL_ELEMENTS = 1 << 14


class CopyDone:
    """An event after a device's queued copies; on CPU, where copies are done when they
    return, it does nothing."""

    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event() if device.type == "cuda" else None

    def record(self) -> None:
        if self._event is not None:
            self._event.record()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


class _Arena:
    """One dtype's host buffer and its device twin, filled from the front each step."""

    def __init__(self, dtype: torch.dtype, device: torch.device, elements: int) -> None:
        pinned = device.type == "cuda"
        self.host = torch.empty(elements, dtype=dtype, pin_memory=pinned)
        self.host_np = self.host.numpy()
        self.device = self.host if device.type == "cpu" else torch.empty(elements, dtype=dtype, device=device)
        self.used = 0
        self.flushed = 0

    @property
    def capacity(self) -> int:
        return self.host.numel()


class FixedField:
    """A field at a fixed address: `device` is what the graph reads; `host` is written each step."""

    def __init__(self, arena: _Arena, start: int, size: int) -> None:
        self.arena = arena
        self.start = start
        self.host = arena.host_np[start : start + size]
        self.device = arena.device[start : start + size]


class StepStaging:
    """Metadata arrays to the device: `stage` each, `flush` once, then read the views."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._arenas: dict[torch.dtype, _Arena] = {}
        self._outgrown: list[_Arena] = []
        """Arenas replaced by larger ones this step whose staged tail is still unflushed."""
        self._copied = CopyDone(self.device)
        self.transfers = 0
        """Host-to-device copies flushed (one per dtype per flush), on any device: on CPU
        the count of copies a GPU would make, so a CPU test checks the same rule."""
        self.staged_arrays = 0
        """Arrays staged; `transfers` stays a few per step however many there are."""
        self._fixed: dict[torch.dtype, _Arena] = {}
        self._fixed_dirty: dict[torch.dtype, tuple[int, int]] = {}
        """Per dtype, the span of fixed fields written since the last flush."""

    def pinned(self) -> bool:
        """Every host buffer is page-locked (what a GPU needs for an asynchronous copy)."""
        return bool(self._arenas) and all(a.host.is_pinned() for a in self._arenas.values())

    def begin_step(self) -> None:
        """Rewinds every buffer, once the copies that read them have completed."""
        self._copied.wait()
        for arena in self._arenas.values():
            arena.used = arena.flushed = 0

    def stage(
        self, values: np.ndarray | list, dtype: torch.dtype, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """The device view that will hold `values` (in `shape`, default 1-D) once `flush` has run."""
        array = np.asarray(values)
        n = array.size
        arena = self._arena(dtype, n)
        start, arena.used = arena.used, arena.used + n
        arena.host_np[start : arena.used] = array.reshape(-1)
        self.staged_arrays += 1
        view = arena.device[start : arena.used]
        return view.view(shape if shape is not None else (n,))

    def reserve(self, dtype: torch.dtype, sizes: list[int]) -> list[FixedField]:
        """Fields of `sizes` elements at addresses that never change, laid out once per dtype."""
        assert dtype not in self._fixed, "a dtype's fixed fields are reserved together, once"
        arena = self._fixed[dtype] = _Arena(dtype, self.device, sum(sizes))
        starts = np.cumsum([0, *sizes[:-1]])
        return [FixedField(arena, int(start), size) for start, size in zip(starts, sizes)]

    def stage_fixed(self, field: FixedField, values: np.ndarray, fill: int | float) -> None:
        """`values` at the front of `field`, the rest of it `fill`; on the device after `flush`."""
        n = len(values)
        field.host[:n] = values
        field.host[n:] = fill
        dtype = field.arena.host.dtype
        lo, hi = self._fixed_dirty.get(dtype, (field.start, field.start))
        self._fixed_dirty[dtype] = (min(lo, field.start), max(hi, field.start + len(field.host)))
        self.staged_arrays += 1

    def flush(self) -> None:
        """One non-blocking copy per dtype of what was staged since the last flush."""
        for dtype, (lo, hi) in self._fixed_dirty.items():
            arena = self._fixed[dtype]
            if arena.device is not arena.host:
                arena.device[lo:hi].copy_(arena.host[lo:hi], non_blocking=True)
            self.transfers += 1
        self._fixed_dirty.clear()
        for arena in [*self._outgrown, *self._arenas.values()]:
            if arena.used > arena.flushed:
                if arena.device is not arena.host:
                    sl = slice(arena.flushed, arena.used)
                    arena.device[sl].copy_(arena.host[sl], non_blocking=True)
                arena.flushed = arena.used
                self.transfers += 1
        self._outgrown.clear()
        self._copied.record()

    def _arena(self, dtype: torch.dtype, n: int) -> _Arena:
        arena = self._arenas.get(dtype)
        if arena is not None and arena.used + n <= arena.capacity:
            return arena
        size = max(INITIAL_ELEMENTS, 2 * (arena.capacity if arena else 0))
        while size < n:
            size *= 2
        if arena is not None and arena.used > arena.flushed:
            self._outgrown.append(arena)
        self._copied.wait()  # a flushed copy may still be reading the old buffer's memory
        self._arenas[dtype] = _Arena(dtype, self.device, size)
        return self._arenas[dtype]


class DeviceToHost:
    """Device tensors read back on the host through a persistent (pinned on CUDA) buffer."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self._copied = CopyDone(self.device)
        self.copies = 0

    def fetch(self, tensor: torch.Tensor) -> np.ndarray:
        """A host copy of the 1-D `tensor`: one non-blocking copy and one wait."""
        n = tensor.numel()
        buf = self._buffers.get(tensor.dtype)
        if buf is None or buf.numel() < n:
            size = max(n, 2 * (buf.numel() if buf is not None else 256))
            buf = torch.empty(size, dtype=tensor.dtype, pin_memory=self.device.type == "cuda")
            self._buffers[tensor.dtype] = buf
        buf[:n].copy_(tensor.reshape(-1), non_blocking=True)
        self._copied.record()
        self._copied.wait()
        self.copies += 1
        return buf[:n].numpy().copy()

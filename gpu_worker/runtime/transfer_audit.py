"""Counts the host-device crossings a block of worker code asks torch for, on any device.

A TorchFunctionMode sees every torch call the code makes, so the same count runs on a CPU,
where no copy crosses a bus, and on a GPU. On a CPU every tensor is on "the device", so a
call is counted by what it would do on a GPU: `.to(device)` and `torch.tensor(...,
device=...)` are host-to-device copies (blocking unless `non_blocking=True`); `.item()`,
`.tolist()` and `.cpu()` read a device tensor on the host (a synchronisation on a GPU);
`copy_` is counted with its `non_blocking` flag. Where a GPU is present, only calls that
cross between host and GPU are counted. Used by benchmarks/gpu_check.py and the tests of
the staging path; never on the serving path.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

_HOST_READS = {"item", "tolist", "cpu"}


def _names_a_device(args: tuple, kwargs: dict) -> bool:
    if "device" in kwargs:
        return kwargs["device"] is not None
    return any(isinstance(a, (str, torch.device)) for a in args[1:])


def _to_host(args: tuple, kwargs: dict) -> bool:
    target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
    return target is not None and torch.device(target).type == "cpu" and torch.cuda.is_available()


def _stays_on_its_device(name: str, args: tuple, kwargs: dict) -> bool:
    """On a machine with a GPU: a copy between tensors on one device, `.to` the device a
    tensor is already on, or reading a host tensor crosses nothing."""
    if name in _HOST_READS and args and isinstance(args[0], torch.Tensor):
        return args[0].device.type == "cpu"
    if name == "copy_" and len(args) >= 2:
        return args[0].device == args[1].device
    if name == "to" and args and isinstance(args[0], torch.Tensor):
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        return target is None or torch.device(target) == args[0].device
    return False


class TransferAudit(TorchFunctionMode):
    """`with TransferAudit() as audit:` then read the counts."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        """Each crossing, by kind and function name (what a failed assertion shows)."""
        self.torch_calls = 0
        """Every torch call made, crossings or not."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.torch_calls += 1
        name = getattr(func, "__name__", str(func))
        kind = self._kind(name, args, kwargs)
        if kind:
            self.calls[f"{kind}:{name}"] += 1
        return func(*args, **kwargs)

    @staticmethod
    def _kind(name: str, args: tuple, kwargs: dict) -> str | None:
        non_blocking = bool(kwargs.get("non_blocking", False))
        if torch.cuda.is_available() and _stays_on_its_device(name, args, kwargs):
            return None
        if name in _HOST_READS:
            return "host_read"
        if name in ("to", "cuda") and (_names_a_device(args, kwargs) or name == "cuda"):
            if _to_host(args, kwargs):
                return "host_read"
            return "to_device_async" if non_blocking else "to_device_blocking"
        if name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            return "to_device_blocking"
        if name == "copy_":
            return "copy_async" if non_blocking else "copy_blocking"
        return None

    def _count(self, kind: str) -> int:
        return sum(n for key, n in self.calls.items() if key.startswith(kind + ":"))

    @property
    def blocking_to_device(self) -> int:
        return self._count("to_device_blocking")

    @property
    def host_reads(self) -> int:
        return self._count("host_read")

    @property
    def non_blocking_copies(self) -> int:
        return self._count("copy_async") + self._count("to_device_async")

    @property
    def blocking_copies(self) -> int:
        return self._count("copy_blocking")

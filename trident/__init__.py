"""trident: an LLM inference server of three kinds of processes over MessagePack/ZeroMQ.

`trident/` holds everything that is not one of the process packages (`tokenizer_proc`,
`scheduler_proc`, `gpu_worker`): the launcher and its supervisor, the node agent, model
resolution, what launch resolves from the flags (`generation_config`: the requests' sampling
defaults; `foreign_flags`: other engines' flags), the offline `Engine` and `run-batch`, the
packaged simulator profiles, and `trident.wire`, the
protocol every process imports. Importing `trident.wire` from a child must stay cheap, so
`Engine` is loaded only when asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "__version__"]

if TYPE_CHECKING:
    from trident.engine import Engine


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from trident.engine import Engine

        return Engine
    raise AttributeError(f"module 'trident' has no attribute {name!r}")

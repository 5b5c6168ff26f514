"""The per-process objects the HTTP routes share, created once by `__main__`.

Routes reach it through `get_state(request)` (it lives on `app.state.frontend`). It holds
configuration and handles to owners elsewhere; it owns no request state of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from tokenizer_proc.metrics import Metrics
from tokenizer_proc.request_manager import RequestManager
from tokenizer_proc.sampling import ModelLimits
from tokenizer_proc.tokenization import TokenStrings
from trident.wire.server_args import ServerArgs


@dataclass
class FrontendState:
    args: ServerArgs
    tokenizer: Any
    manager: RequestManager
    metrics: Metrics
    strings: TokenStrings = field(init=False)
    started_at: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.strings = TokenStrings(self.tokenizer)

    @property
    def limits(self) -> ModelLimits:
        """From the scheduler's latest ServerInfo (it may change after a scheduler restart)."""
        info = self.manager.server_info
        assert info is not None, "the HTTP server starts only after the scheduler handshake"
        return ModelLimits(self.args.served_model_name, info.context_length, info.vocab_size)


def get_state(request: Request) -> FrontendState:
    return request.app.state.frontend

"""The per-process objects the HTTP routes share, created once by `__main__`.

Routes reach it through `get_state(request)` (it lives on `app.state.frontend`). It holds
configuration and handles to owners elsewhere; of request state it owns only the responses
/v1/responses stores (`responses_store`), which outlive their requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from tokenizer_proc.metrics import Metrics
from tokenizer_proc.reasoning import uses_reasoning_parser
from tokenizer_proc.request_manager import RequestManager
from tokenizer_proc.responses_store import BackgroundResponses, ResponseStore
from tokenizer_proc.sampling import ModelLimits
from tokenizer_proc.tokenization import TokenStrings, fim_tokens_of
from tokenizer_proc.tool_formats import choose_tool_format
from tokenizer_proc.tool_parsers import ToolCallFormat
from trident.wire.server_args import ServerArgs


@dataclass
class FrontendState:
    args: ServerArgs
    tokenizer: Any
    manager: RequestManager
    metrics: Metrics
    strings: TokenStrings = field(init=False)
    tool_format: ToolCallFormat | None = field(init=False)
    """How this model writes tool calls (`--tool-call-parser`); None: calls stay text."""
    model_reasons: bool = field(init=False)
    """Its `<think>` output goes to `reasoning_content` (`--reasoning-parser`)."""
    responses: ResponseStore = field(init=False)
    background_responses: BackgroundResponses = field(init=False)
    fim_tokens: tuple[str, str, str] | None = field(init=False)
    """The model's fill-in-the-middle markers (completions' `suffix`); None: it has none."""
    started_at: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.strings = TokenStrings(self.tokenizer)
        self.tool_format = choose_tool_format(self.args.tool_call_parser, self.tokenizer)
        self.model_reasons = uses_reasoning_parser(self.args.reasoning_parser, self.tokenizer)
        self.responses = ResponseStore(self.args.responses_store_size)
        self.background_responses = BackgroundResponses(self.manager.abort)
        self.fim_tokens = fim_tokens_of(self.tokenizer)

    @property
    def limits(self) -> ModelLimits:
        """From the scheduler's latest ServerInfo (it may change after a scheduler restart)."""
        info = self.manager.server_info
        assert info is not None, "the HTTP server starts only after the scheduler handshake"
        return ModelLimits.of(self.args, info)


def get_state(request: Request) -> FrontendState:
    return request.app.state.frontend

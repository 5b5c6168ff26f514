"""What the offline Engine (trident/engine.py) uses of this process, and nothing else.

The Engine plays this process's part in the caller's Python process, with this process's own
code: it loads the tokenizer, runs a `RequestManager` (sockets, handshake, detokenizer, stop
strings) on its own event loop, validates `/generate`'s sampling parameters, logprob fields
and prompt into the wire's `SamplingParams`, and collects each request and formats its
logprobs as `POST /generate` would; its chats go through the chat template as the chat
route's do, and its beam search is the OpenAI routes' `use_beam_search`.
The names below are that whole interface: trident/ imports nothing else from tokenizer_proc
(tests/test_layering.py checks it), so any other module here can change without the Engine.
"""

from tokenizer_proc.beam_search import all_or_none, beam_search
from tokenizer_proc.errors import APIError
from tokenizer_proc.metrics import Metrics
from tokenizer_proc.prompt_logprobs_format import LogprobMeta
from tokenizer_proc.protocol import MAX_BEAM_WIDTH, NativeLogprobs, NativeSamplingParams
from tokenizer_proc.request_handle import SchedulingOptions
from tokenizer_proc.request_manager import RequestManager
from tokenizer_proc.sampling import ModelLimits, check_prompt_ids, native_sampling_params, resolve_max_tokens
from tokenizer_proc.serving import collect
from tokenizer_proc.tokenization import TokenStrings, apply_chat_template, encode_text, load_tokenizer

__all__ = [
    "MAX_BEAM_WIDTH",
    "APIError",
    "LogprobMeta",
    "Metrics",
    "ModelLimits",
    "NativeLogprobs",
    "NativeSamplingParams",
    "RequestManager",
    "SchedulingOptions",
    "TokenStrings",
    "all_or_none",
    "apply_chat_template",
    "beam_search",
    "check_prompt_ids",
    "collect",
    "encode_text",
    "load_tokenizer",
    "native_sampling_params",
    "resolve_max_tokens",
]

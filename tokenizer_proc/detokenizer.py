"""Incremental detokenization of one request's output, with UTF-8 hold-back and stop strings.

Owned by the request's generator in `request_manager`; nothing else touches it. Each
`RequestDetokenizer.step` takes the token ids one scheduler step produced and returns only
the text that is new and final:

- `IncrementalDecoder` decodes a small window of ids (the "prefix" window, as in vLLM and
  SGLang) instead of the whole output each step, and holds back text that ends in an
  incomplete UTF-8 sequence (the tokenizer decodes it as U+FFFD) until the next token
  completes it.
- `StopStringMatcher` applies OpenAI stop strings: everything after the stop string is never
  emitted, nor the stop string itself unless the request keeps it (`TextOptions.keep_stop`);
  while streaming, a tail that could be the start of a stop string is held back until it is
  known not to be one.

    ids:    [ ......... already emitted ......... | prefix window | new ids ]
                                       prefix_offset ^    read_offset ^
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizer_proc.tokenization import text_decoder

REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class TextOptions:
    """How a request's output ids become its text: the client's fields, one set per request."""

    stop: Sequence[str] = ()
    """Stop strings: the text ends at the first one the output writes."""
    keep_stop: bool = False
    """The text keeps what stopped it, the stop string or a stop token's text (vLLM's
    `include_stop_str_in_output`, SGLang's `no_stop_trim`); else both are cut off."""
    skip_special_tokens: bool = True


class IncrementalDecoder:
    """Token ids in, new complete text out; works for byte-level BPE and SentencePiece."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._decode_ids = text_decoder(tokenizer)
        self._skip_special = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._decode_ids(ids, self._skip_special)

    def push(self, new_ids: Iterable[int], final: bool = False) -> str:
        """Append ids; return the text they complete (nothing while a character is partial).

        With `final`, whatever is pending is returned, even an incomplete character.
        """
        self.ids.extend(new_ids)
        if self._read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.ids[self._prefix_offset :])
        if not final and full_text.endswith(REPLACEMENT_CHAR):
            return ""
        if len(full_text) <= len(prefix_text) and not final:
            # A token that decodes to nothing (a skipped special token): move on.
            self._read_offset = len(self.ids)
            return ""
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        return new_text


class StopStringMatcher:
    """Cuts the text at the first stop string; holds back a possible stop-string prefix."""

    def __init__(self, stops: Sequence[str], keep_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self._keep_stop = keep_stop
        self._max_len = max((len(s) for s in self.stops), default=0)
        self.text = ""
        """All text accepted so far (cut at the stop string once one is hit)."""
        self._sent = 0
        self.stopped = False
        self.matched: str | None = None
        """The stop string that ended the text, once one has."""

    def feed(self, delta: str, final: bool = False) -> str:
        """Add decoded text; return the part that may be emitted now."""
        if self.stopped:
            return ""
        if not self.stops:
            self.text += delta
            out = self.text[self._sent :]
            self._sent = len(self.text)
            return out
        # A match must end inside the new text, so it starts at most max_len - 1 before it.
        search_from = max(0, len(self.text) - self._max_len + 1)
        self.text += delta
        hit, end_of_stop = -1, -1
        for stop in self.stops:
            pos = self.text.find(stop, search_from)
            if pos != -1 and (hit == -1 or pos < hit):
                hit, end_of_stop = pos, pos + len(stop)
        if hit != -1:
            self.stopped = True
            self.matched = self.text[hit:end_of_stop]
            self.text = self.text[: end_of_stop if self._keep_stop else hit]
        end = len(self.text) if (final or self.stopped) else len(self.text) - self._partial_stop_len()
        end = max(end, self._sent)
        out = self.text[self._sent : end]
        self._sent = end
        return out

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the unsent text that begins some stop string."""
        unsent = len(self.text) - self._sent
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, unsent), best, -1):
                if self.text.endswith(stop[:k]):
                    best = k
                    break
        return best


@dataclass
class DetokenizedStep:
    text: str
    """New text to send to the client (may be empty)."""
    stop_string_hit: bool
    """A stop string ended the output: finish with "stop" and abort in the scheduler."""
    stop_reason: int | str | None = None
    """vLLM's: the stop string or the request's stop token id that ended the output (None
    while running, and for the end-of-sequence token or the length limit)."""


class RequestDetokenizer:
    """Per-request text state: incremental decoding followed by stop-string matching."""

    def __init__(
        self,
        tokenizer: Any,
        options: TextOptions = TextOptions(),
        stop_token_ids: Iterable[int] = (),
        text_at_end_only: bool = False,
    ) -> None:
        self.decoder = IncrementalDecoder(tokenizer, options.skip_special_tokens)
        self.matcher = StopStringMatcher(options.stop, options.keep_stop)
        self._request_stop_ids = set(stop_token_ids)
        self._stop_token_ids = self._request_stop_ids if not options.keep_stop else set()
        """Stop tokens whose text is cut off the output (none when the request keeps it)."""
        self._deferred: list[int] | None = [] if text_at_end_only and not options.stop else None
        """A caller that wants the text only at the end (not streaming) and no stop string
        to look for: ids wait here and are decoded once, at the last step, instead of twice
        a step (the tokenizer's largest per-token cost with thousands of requests open)."""

    @property
    def text(self) -> str:
        return self.matcher.text

    def step(self, token_ids: Sequence[int], finish_reason: str | None = None) -> DetokenizedStep:
        """Feed one step's ids; `finish_reason` set means this is the request's last step."""
        final = finish_reason is not None
        if self._deferred is not None:
            self._deferred += token_ids
            if not final:
                return DetokenizedStep("", False)
            token_ids = self._deferred
        ids = list(token_ids)
        stop_reason: int | str | None = None
        if finish_reason == "stop" and ids and ids[-1] in self._request_stop_ids:
            stop_reason = ids[-1]
            if ids[-1] in self._stop_token_ids:
                ids = ids[:-1]  # OpenAI semantics: the stop token's text is not part of the output
        delta = self.decoder.push(ids, final=final)
        out = self.matcher.feed(delta, final=final)
        return DetokenizedStep(out, self.matcher.stopped, self.matcher.matched or stop_reason)

"""The offline API: trident's scheduler and workers driven from Python, without HTTP.

    from trident.engine import Engine

    with Engine(dtype="float32") as engine:
        outs = engine.generate(["The capital of France is"], {"temperature": 0, "max_new_tokens": 16})
        print(outs[0]["text"])

`Engine(model=None, **server_flags)` takes the flags of `trident serve` as keyword arguments
named as the `ServerArgs` fields (`max_total_tokens=16384`, `disable_radix_cache=True`,
`compile_decode="on"`, `startup_timeout_s=60`...) and starts the same worker and
scheduler processes through launch.py's `Launcher`, in a private run directory. The Engine
itself plays the tokenizer process's part, with that process's own code (reached through
tokenizer_proc/offline.py, its one interface): the tokenizer loading, the `RequestManager`
(sockets, handshake, per-request detokenizer and stop strings) and `serving.collect`, run
on a private asyncio loop in one background thread. So the Engine swaps the I/O (Python
calls instead of HTTP), not the logic, and returns what `POST /generate` returns.

`sampling_params` are those of `POST /generate` (SGLang's names: `max_new_tokens`,
`temperature`, `top_p`, `top_k`, `min_p`, the penalties, `stop`, `stop_token_ids`,
`ignore_eos`, `min_new_tokens`, `seed`, `skip_special_tokens`, `no_stop_trim`, `logit_bias`,
`allowed_token_ids`, and one
decoding constraint of `regex`, `ebnf` or `json_schema`); an unknown name, an out-of-range
value or a constraint the grammar library refuses raises ValueError before anything is sent.

Logprobs are asked for as in SGLang's `Engine.generate` and `POST /generate`, and come back
under /generate's names beside each result's text:

    outs = engine.generate(prompts, {"max_new_tokens": 1}, return_logprob=True, logprob_start_len=0)
    outs[0]["input_token_logprobs"]  # [logprob, token id, None] per prompt token; the first's logprob None

A chat is vLLM's `LLM.chat`: conversations through the model's chat template, then generated:

    outs = engine.chat([{"role": "user", "content": "Hi!"}], {"temperature": 0, "max_new_tokens": 16})

Beam search is vLLM's `LLM.beam_search`, the same search as the OpenAI routes' `use_beam_search`:

    beams = engine.beam_search(["The capital of France is"], beam_width=3, max_tokens=16)
    beams[0][0]["text"], beams[0][0]["cum_logprob"]  # the first prompt's best beam
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import pydantic
import zmq.asyncio

from tokenizer_proc.offline import (
    MAX_BEAM_WIDTH,
    APIError,
    LogprobMeta,
    Metrics,
    ModelLimits,
    NativeLogprobs,
    NativeSamplingParams,
    RequestManager,
    SchedulingOptions,
    TokenStrings,
    all_or_none,
    apply_chat_template,
    beam_search,
    check_prompt_ids,
    collect,
    encode_text,
    load_tokenizer,
    native_sampling_params,
    resolve_max_tokens,
)
from trident.flags import argv_of, build_parser
from trident.launch import Launcher, StartupError, server_args_from_cli
from trident.model_source import ModelNotFound, resolve_model
from trident.wire.server_args import write_server_args

CHILD_CHECK_INTERVAL_S = 0.5
"""While waiting for outputs, how often the Engine checks that its processes are alive."""


def parse_engine_flags(model: str | None, server_flags: Mapping[str, Any]) -> argparse.Namespace:
    """The command line of `trident serve` that these keyword flags spell, parsed by its parser.

    Raises TypeError for a name that is not a ServerArgs flag field, ValueError for a value
    the command line would refuse.
    """
    if "model_path" in server_flags:
        raise TypeError("Engine() takes the model as `model`")
    argv = argv_of({"model_path": model, **server_flags})
    try:
        return build_parser().parse_args(argv)
    except SystemExit as e:  # argparse already printed why
        raise ValueError(f"invalid Engine flags: {dict(server_flags)}") from e


class _Processes:
    """What an Engine must release: its processes, I/O thread and run directory.

    Kept apart from the Engine so that `weakref.finalize` can release them when a
    forgotten Engine is collected or the interpreter exits, not only on `shutdown()`.
    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.launcher: Launcher | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.zmq_ctx: zmq.asyncio.Context | None = None
        self.manager: RequestManager | None = None
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.loop is not None and self.thread is not None and self.thread.is_alive():
            manager, ctx = self.manager, self.zmq_ctx

            async def close_io() -> None:
                if manager is not None:
                    manager.abort_all()
                    await asyncio.sleep(0)  # let the AbortReqs leave
                    await manager.close()
                if ctx is not None:
                    ctx.term()

            try:
                asyncio.run_coroutine_threadsafe(close_io(), self.loop).result(timeout=5)
            except Exception:  # a broken loop must not keep the processes alive
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
            if ctx is not None and not ctx.closed and not self.thread.is_alive():
                # close_io did not finish (a loaded host): closed here, the context cannot
                # later block the garbage collector in its own term() on an open socket.
                ctx.destroy(linger=0)
        if self.loop is not None and not self.loop.is_running():
            self.loop.close()
        if self.launcher is not None:
            self.launcher.stop_all()
        shutil.rmtree(self.run_dir, ignore_errors=True)


class Engine:
    """Runs trident's worker and scheduler processes and plays the tokenizer's part in-process."""

    def __init__(self, model: str | None = None, **server_flags: Any) -> None:
        ns = parse_engine_flags(model, server_flags)
        try:
            model_path, served_name = resolve_model(ns.model_path, ns.gguf_file)
        except ModelNotFound as e:
            raise ValueError(str(e)) from None
        self._procs = _Processes(tempfile.mkdtemp(prefix="trident-engine-"))  # mode 0700
        self._finalizer = weakref.finalize(self, self._procs.close)
        try:
            self.args = server_args_from_cli(ns, model_path, served_name, self._procs.run_dir)
            args_file = os.path.join(self._procs.run_dir, "server_args.msgpack")
            write_server_args(self.args, args_file)
            self.tokenizer = load_tokenizer(self.args.tokenizer_source, chat_template=self.args.chat_template)
            self.strings = TokenStrings(self.tokenizer)
            self._procs.launcher = Launcher(self.args, args_file)
            self._start_backend()
            self._start_io()
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ start and stop

    def _start_backend(self) -> None:
        """launch.py's start-up minus the tokenizer process: the worker ranks, then the scheduler."""
        assert self._procs.launcher is not None
        try:
            self._procs.launcher.start_all(with_tokenizer=False)
        except StartupError as e:
            raise RuntimeError(f"trident Engine could not start: {e}") from None

    def _start_io(self) -> None:
        """The tokenizer process's RequestManager, on a private event loop in one thread."""
        procs = self._procs
        procs.loop = asyncio.new_event_loop()
        procs.thread = threading.Thread(target=procs.loop.run_forever, name="trident-engine-io", daemon=True)
        procs.thread.start()

        async def connect() -> RequestManager:
            procs.zmq_ctx = zmq.asyncio.Context()
            procs.manager = RequestManager(procs.zmq_ctx, self.args, self.tokenizer, Metrics())
            await procs.manager.handshake(self.args.startup_timeout_s)
            procs.manager.start()
            return procs.manager

        self._manager = self._run(connect())
        info = self._manager.server_info
        assert info is not None
        self.limits = ModelLimits.of(self.args, info)

    def shutdown(self) -> None:
        """Aborts open requests, stops every process, removes the run directory. Idempotent."""
        self._finalizer()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def pids(self) -> list[int]:
        """Process ids of the worker ranks and the scheduler."""
        launcher = self._procs.launcher
        return [c.proc.pid for c in launcher.children] if launcher else []

    @property
    def run_dir(self) -> str:
        return self._procs.run_dir

    # ------------------------------------------------------------------ generation

    def default_sampling_params(self) -> dict[str, int | float]:
        """What a request that leaves a sampling field out gets in its place, by
        `sampling_params` name (vLLM's `LLM.get_default_sampling_params`): the model's
        recommendation, under the `generation_config` and `override_generation_config` flags."""
        return dict(self.args.sampling_defaults)

    def generate(
        self,
        prompts: str | Sequence[str],
        sampling_params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        *,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
    ) -> list[dict[str, Any]]:
        """One result per prompt, in order: text, output_ids, finish_reason, token counts.

        `sampling_params` is one dict for every prompt, or one dict per prompt. All prompts
        are submitted at once, so the scheduler batches them. With `return_logprob`, each
        result also holds /generate's `output_token_logprobs` and `output_top_logprobs`, and
        from prompt position `logprob_start_len` on (-1: none) `input_token_logprobs` and
        `input_top_logprobs`: [logprob, token id, text or None] entries, `top_logprobs_num`
        of them per top list, the text with `return_text_in_logprobs`.
        """
        if self._procs.closed:
            raise RuntimeError("this Engine has been shut down")
        prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
        if sampling_params is None or isinstance(sampling_params, Mapping):
            param_list = [sampling_params or {}] * len(prompt_list)
        else:
            param_list = list(sampling_params)
            if len(param_list) != len(prompt_list):
                raise ValueError(f"{len(prompt_list)} prompts but {len(param_list)} sampling_params")
        try:
            logprobs = NativeLogprobs(
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len,
                top_logprobs_num=top_logprobs_num,
                return_text_in_logprobs=return_text_in_logprobs,
            )
        except pydantic.ValidationError as e:
            raise ValueError(f"invalid logprob parameters: {e}") from None
        for prompt in prompt_list:
            if not isinstance(prompt, str) or not prompt:
                raise ValueError("each prompt must be a non-empty string")
        ids = [encode_text(self.tokenizer, p) for p in prompt_list]
        requests = [self._prepare(i, sp, logprobs) for i, sp in zip(ids, param_list, strict=True)]
        return self._run(self._generate_all(requests, logprobs))

    def chat(
        self,
        conversations: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """vLLM's `LLM.chat`: each conversation (a list of {"role", "content"} messages, or a
        list of such lists) through the model's chat template, as POST /v1/chat/completions
        renders it, then generated as `generate` does; one result per conversation."""
        if self._procs.closed:
            raise RuntimeError("this Engine has been shut down")
        single = bool(conversations) and isinstance(conversations[0], Mapping)
        conversation_list = [conversations] if single else list(conversations)
        logprobs = NativeLogprobs()
        requests = []
        for messages in conversation_list:
            try:
                _, ids = apply_chat_template(
                    self.tokenizer,
                    [dict(m) for m in messages],
                    add_generation_prompt=add_generation_prompt and not continue_final_message,
                    continue_final_message=continue_final_message,
                    template_kwargs={**(self.args.default_chat_template_kwargs or {}), **(chat_template_kwargs or {})},
                )
            except Exception as e:  # the template refuses this conversation
                raise ValueError(f"the messages do not fit the model's chat template: {e}") from None
            requests.append(self._prepare(ids, sampling_params or {}, logprobs))
        return self._run(self._generate_all(requests, logprobs))

    def beam_search(
        self,
        prompts: str | Sequence[str],
        beam_width: int,
        max_tokens: int,
        *,
        length_penalty: float = 1.0,
        ignore_eos: bool = False,
    ) -> list[list[dict[str, Any]]]:
        """vLLM's `LLM.beam_search`: for each prompt, its `beam_width` best beams, best first,
        each {text, output_ids, cum_logprob, finish_reason}, searched as the OpenAI routes'
        `use_beam_search` does (tokenizer_proc/beam_search.py). The prompts run concurrently."""
        if self._procs.closed:
            raise RuntimeError("this Engine has been shut down")
        if not 1 <= beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be 1 to {MAX_BEAM_WIDTH}, got {beam_width}")
        prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
        try:
            prompt_ids = [encode_text(self.tokenizer, p) for p in prompt_list]
            steps = [resolve_max_tokens(len(ids), max_tokens, self.limits, "max_tokens") for ids in prompt_ids]
            for ids in prompt_ids:
                check_prompt_ids(ids, self.limits)
        except APIError as e:
            raise ValueError(e.message) from None
        info = self._manager.server_info
        assert info is not None
        end_ids = set() if ignore_eos else set(info.eos_token_ids)

        searches = [
            beam_search(
                self._manager,
                None,
                ids,
                width=beam_width,
                steps=n,
                length_penalty=length_penalty,
                end_ids=end_ids,
                top_logprobs=0,
                scheduling=SchedulingOptions(),
                rid=self._manager.new_rid("engine-beam"),
            )
            for ids, n in zip(prompt_ids, steps, strict=True)
        ]

        return [
            [
                {
                    "text": self.tokenizer.decode(b.text_ids(), skip_special_tokens=True),
                    "output_ids": b.token_ids,
                    "cum_logprob": b.cum_logprob,
                    "finish_reason": b.finish_reason or "length",
                }
                for b in beams
            ]
            for beams in self._run(all_or_none(searches))
        ]

    def _prepare(
        self, ids: list[int], params: Mapping[str, Any], logprobs: NativeLogprobs
    ) -> tuple[list[int], Any, NativeSamplingParams]:
        unknown = set(params) - set(NativeSamplingParams.model_fields)
        if unknown:
            raise ValueError(f"unknown sampling parameters: {sorted(unknown)}")
        try:
            native = NativeSamplingParams.model_validate(dict(params))
            check_prompt_ids(ids, self.limits)
            wire_params = native_sampling_params(native, len(ids), self.limits, "prompt", logprobs)
        except pydantic.ValidationError as e:
            raise ValueError(f"invalid sampling parameters: {e}") from None
        except APIError as e:
            raise ValueError(e.message) from None
        return ids, wire_params, native

    async def _generate_all(
        self, requests: list[tuple[list[int], Any, NativeSamplingParams]], logprobs: NativeLogprobs
    ) -> list[dict]:
        manager = self._manager
        handles = []
        try:
            for ids, params, native in requests:
                handles.append(
                    await manager.submit(
                        ids,
                        params,
                        rids=[manager.new_rid("engine")],
                        text=native.text_options(),
                        check_capacity=False,
                    )
                )
            results = await asyncio.gather(*(collect(None, h) for h in handles))
        except APIError as e:  # a request the scheduler failed
            raise RuntimeError(e.message) from None
        finally:
            for hs in handles:  # aborts whatever did not finish (cancelled, failed)
                for h in hs:
                    h.close()
        outs = []
        for (ids, _, _), (r,) in zip(requests, results, strict=True):
            out = {
                "text": r.text,
                "output_ids": r.token_ids,
                "finish_reason": r.finish_reason,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "cached_tokens": r.cached_tokens,
            }
            if logprobs.return_logprob:
                out.update(LogprobMeta(logprobs, self.strings, ids).fields(r))
            outs.append(out)
        return outs

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Runs coro on the I/O loop; raises if a process dies meanwhile; Ctrl-C cancels it."""
        assert self._procs.loop is not None
        future = asyncio.run_coroutine_threadsafe(coro, self._procs.loop)
        try:
            while True:
                try:
                    return future.result(timeout=CHILD_CHECK_INTERVAL_S)
                except FutureTimeout:
                    dead = self._dead_children()
                    if dead:
                        raise RuntimeError(f"trident Engine: {', '.join(dead)} exited") from None
        except BaseException:
            future.cancel()  # cancelling the task closes its handles: the scheduler aborts them
            raise

    def _dead_children(self) -> list[str]:
        launcher = self._procs.launcher
        if launcher is None:
            return []
        return [
            f"{c.name} (pid {c.proc.pid}, code {c.proc.returncode})"
            for c in launcher.children
            if c.proc.poll() is not None
        ]

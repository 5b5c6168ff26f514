"""Open requests of the tokenizer process and its sockets to the schedulers.

Ownership: the scheduler (of the data-parallel replica the router picked) owns each
request's state (queue position, KV, produced tokens);
this manager holds, per open rid, only what the HTTP side needs: the queue of `TokenOut`s
the receive task dispatches to, the prompt and the tokens seen so far (to resubmit after a
scheduler restart), and the detokenizer. A request is open from `submit` until its
`RequestHandle` sees a finish or is closed; closing an unfinished one (client gone, stop
string hit, task cancelled) sends `AbortReq` so that the scheduler frees its KV.

The manager also keeps each scheduler's latest `SchedulerStats` and `ServerInfo` (mirrors in
`ReplicaSet`, refreshed only by the receive task) and sends `FlushCacheReq` to every
scheduler, answering once all their `FlushCacheDone`s are in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq.asyncio

from tokenizer_proc.detokenizer import RequestDetokenizer, TextOptions
from tokenizer_proc.errors import SERVER_ERROR, SERVER_UNAVAILABLE, APIError
from tokenizer_proc.metrics import Metrics
from tokenizer_proc.replicas import ReplicaSet
from tokenizer_proc.request_handle import OpenRequest, RequestHandle, SchedulingOptions, TokenOut
from trident.wire.codec import pack_int32
from trident.wire.control import PROTOCOL_VERSION, check_protocol_version
from trident.wire.frontend import (
    AbortReq,
    EmbedReq,
    FlushCacheDone,
    FlushCacheReq,
    GenerateReq,
    SamplingParams,
    SchedulerStats,
    ServerHealth,
    ServerInfo,
    TokenizerHello,
    TokenizerInput,
    TokenOutBatch,
)
from trident.wire.server_args import ServerArgs
from trident.wire.transport import ENDPOINT_TOKENIZER_IN, AsyncPullSocket, endpoint

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


class Overloaded(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            f"The server is overloaded ({limit} requests open); retry later.",
            503,
            type_=SERVER_ERROR,
            code="overloaded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


class RequestManager:
    """The tokenizer side of the tokenizer<->scheduler link; one per process."""

    def __init__(
        self, zmq_ctx: zmq.asyncio.Context, args: ServerArgs, tokenizer: Any, metrics: Metrics | None = None
    ) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.replicas = ReplicaSet(zmq_ctx, args)
        self._pull = AsyncPullSocket(
            zmq_ctx,
            endpoint(args.run_dir, ENDPOINT_TOKENIZER_IN),
            bind=True,
            union=TokenizerInput,
            name="tokenizer.in",
        )
        self._open: dict[str, OpenRequest] = {}
        self.draining = False
        """Set on SIGTERM: new requests get 503 while open ones finish."""
        self.health = ServerHealth(healthy=True, restarts=0)
        """launch.py's latest word on restarts; unhealthy means every request gets 503."""
        self._flush_lock = asyncio.Lock()
        self._flush_waiter: asyncio.Future[FlushCacheDone] | None = None
        self._flush_answers: dict[int, FlushCacheDone] = {}
        self._recv_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()

    # ---- start-up -------------------------------------------------------------------

    @property
    def server_info(self) -> ServerInfo | None:
        """The schedulers' ServerInfo merged (the strictest limits, the summed capacity)."""
        return self.replicas.merged_info()

    @property
    def stats(self) -> SchedulerStats | None:
        """Every scheduler's latest stats, summed."""
        return self.replicas.merged_stats()

    async def handshake(self, timeout_s: float) -> ServerInfo:
        """Send TokenizerHello to every scheduler, wait for all their ServerInfos; raises
        ProtocolMismatch or TimeoutError."""
        await self.replicas.broadcast(TokenizerHello(PROTOCOL_VERSION, os.getpid()))

        async def wait_infos() -> None:
            while any(i is None for i in self.replicas.infos):
                msg = await self._pull.recv()
                if isinstance(msg, ServerInfo) and self._valid_replica(msg.dp_rank):
                    check_protocol_version(f"scheduler of replica {msg.dp_rank}", msg.protocol_version)
                    self.replicas.infos[msg.dp_rank] = msg
                elif isinstance(msg, SchedulerStats) and self._valid_replica(msg.dp_rank):
                    self.replicas.stats[msg.dp_rank] = msg
                else:
                    logger.warning("ignoring %s received before ServerInfo", type(msg).__name__)

        await asyncio.wait_for(wait_infos(), timeout_s)
        return self.server_info

    def _valid_replica(self, dp_rank: int) -> bool:
        if 0 <= dp_rank < self.replicas.size:
            return True
        logger.warning("ignoring a message from replica %d: there are %d", dp_rank, self.replicas.size)
        return False

    def start(self) -> None:
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop(), name="tokenizer-recv")

    async def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        self.replicas.close()
        self._pull.close()

    # ---- requests -------------------------------------------------------------------

    @property
    def num_open(self) -> int:
        return len(self._open)

    @property
    def capacity(self) -> int:
        running = self.server_info.max_running_requests if self.server_info else self.args.max_running_requests
        return running + self.args.max_queued_requests

    @property
    def dropped_frames(self) -> int:
        """Frames this process dropped as malformed (the scheduler's are in its stats)."""
        return self._pull.dropped

    @staticmethod
    def new_rid(prefix: str = "req") -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    async def submit(
        self,
        prompt_ids: Sequence[int],
        sampling: Sequence[SamplingParams] | SamplingParams,
        *,
        rids: Sequence[str] | None = None,
        rids_param: str = "rid",
        text: TextOptions = TextOptions(),
        scheduling: SchedulingOptions = SchedulingOptions(),
        check_capacity: bool = True,
        stream: bool = True,
        first_index: int = 0,
    ) -> list[RequestHandle]:
        """Open one request per SamplingParams (n > 1) and send them, their choice indices
        `first_index` on (a batch of prompts numbers its choices across them); raises
        Overloaded (503), or a 400 naming `rids_param` (the field the client named them in)
        for an id already open."""
        params = [sampling] if isinstance(sampling, SamplingParams) else list(sampling)
        rids = list(rids) if rids is not None else [self.new_rid() for _ in params]
        self._check_can_open(rids, check_capacity, rids_param)
        prompt = list(prompt_ids)
        packed = pack_int32(prompt)
        replica = self.replicas.router.choose(prompt)  # the n choices share their prompt's cache
        self.replicas.router.opened(replica, prompt, len(params))
        handles = []
        for index, (rid, sp) in enumerate(zip(rids, params, strict=True), start=first_index):
            detok = RequestDetokenizer(self.tokenizer, text, sp.stop_token_ids, text_at_end_only=not stream)
            req = OpenRequest(rid, index, prompt, sp, detok, replica, scheduling=scheduling)
            self._open[rid] = req
            handles.append(RequestHandle(self, req))
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(prompt) * len(params))
        try:
            for handle, sp in zip(handles, params, strict=True):
                boot_id = self.replicas.boot_id(replica)
                msg = GenerateReq(
                    handle.rid,
                    packed,
                    sp,
                    scheduler_boot_id=boot_id,
                    cache_salt=scheduling.cache_salt,
                    priority=scheduling.priority,
                )
                await self.replicas.send(replica, msg)
        except BaseException:
            for handle in handles:
                handle.close()
            raise
        return handles

    async def submit_embeddings(self, inputs: Sequence[Sequence[int]], rids: Sequence[str]) -> list[RequestHandle]:
        """Open one embedding request (`EmbedReq`) per tokenized input and send them, each to
        the replica its tokens route to; raises Overloaded (503)."""
        self._check_can_open(rids, check_capacity=True, rids_param="rid")
        reqs, handles = [], []
        for index, (rid, ids) in enumerate(zip(rids, inputs, strict=True)):
            prompt = list(ids)
            replica = self.replicas.router.choose(prompt)
            self.replicas.router.opened(replica, prompt, 1)
            detok = RequestDetokenizer(self.tokenizer, text_at_end_only=True)
            req = OpenRequest(rid, index, prompt, SamplingParams(max_new_tokens=0), detok, replica, embedding=True)
            self._open[rid] = req
            reqs.append(req)
            handles.append(RequestHandle(self, req))
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(sum(len(ids) for ids in inputs))
        try:
            for req in reqs:
                await self.replicas.send(req.replica, self._embed_req(req))
        except BaseException:
            for handle in handles:
                handle.close()
            raise
        return handles

    def _embed_req(self, req: OpenRequest) -> EmbedReq:
        return EmbedReq(req.rid, pack_int32(req.prompt_ids), self.replicas.boot_id(req.replica))

    def _check_can_open(self, rids: Sequence[str], check_capacity: bool, rids_param: str) -> None:
        """Raises the 503 of a draining or unhealthy server or a full queue (`check_capacity`),
        or a 400 for a rid already open."""
        if self.draining:
            raise APIError("the server is shutting down", 503, type_=SERVER_ERROR, headers={"Retry-After": "5"})
        if not self.health.healthy:
            raise APIError(
                f"{SERVER_UNAVAILABLE}: {self.health.last_cause}", 503, type_=SERVER_ERROR, headers={"Retry-After": "5"}
            )
        if check_capacity and len(self._open) + len(rids) > self.capacity:
            raise Overloaded(self.capacity)
        for rid in rids:
            if rid in self._open:
                raise APIError(f"Request id {rid!r} is already in use.", param=rids_param)

    def abort(self, rid: str) -> list[str]:
        """Abort `rid` and its choices (`rid-0`, `rid-1`...); they finish with "abort"."""
        hits = [r for r in self._open if r == rid or r.startswith(rid + "-")]
        for r in hits:
            req = self._open[r]
            if not req.scheduler_done:
                req.scheduler_done = True
                self._send_soon(req.replica, AbortReq(r))
            req.queue.put_nowait(TokenOut(r, [], finish_reason="abort"))
        return hits

    def abort_all(self) -> int:
        """Finish every open request with "abort" (shutdown): streams end cleanly, not cut."""
        rids = list(self._open)
        for rid in rids:
            self.abort(rid)
        return len(rids)

    def release(self, req: OpenRequest) -> None:
        if self._open.get(req.rid) is req:
            del self._open[req.rid]
            self.replicas.router.closed(req.replica)
        if not req.scheduler_done:
            req.scheduler_done = True
            self._send_soon(req.replica, AbortReq(req.rid))

    def _send_soon(self, replica: int, msg: Any) -> None:
        """Send from sync code (a generator's finally, a cancelled task) without awaiting."""
        task = asyncio.get_running_loop().create_task(self.replicas.send(replica, msg))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- control --------------------------------------------------------------------

    async def flush_cache(self, timeout_s: float = 30.0) -> FlushCacheDone:
        """Every replica flushes; ok only if all did."""
        async with self._flush_lock:
            self._flush_waiter = asyncio.get_running_loop().create_future()
            self._flush_answers = {}
            try:
                await self.replicas.broadcast(FlushCacheReq())
                return await asyncio.wait_for(self._flush_waiter, timeout_s)
            except asyncio.TimeoutError:
                missing = sorted(set(range(self.replicas.size)) - set(self._flush_answers))
                return FlushCacheDone(False, f"schedulers {missing} did not answer within {timeout_s:g}s")
            finally:
                self._flush_waiter = None

    def _on_flush_done(self, msg: FlushCacheDone) -> None:
        if self._flush_waiter is None or self._flush_waiter.done():
            return
        self._flush_answers[msg.dp_rank] = msg
        if len(self._flush_answers) == self.replicas.size:
            answers = [self._flush_answers[d] for d in sorted(self._flush_answers)]
            message = "; ".join(a.message for a in answers if a.message)
            self._flush_waiter.set_result(FlushCacheDone(all(a.ok for a in answers), message))

    # ---- receive task ---------------------------------------------------------------

    async def _recv_loop(self) -> None:
        while True:
            msg = await self._pull.recv()
            try:
                self._dispatch(msg)
            except Exception:  # one bad message must not stop every request
                logger.exception("failed to handle %s from the scheduler", type(msg).__name__)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, TokenOutBatch):
            for rid, token_ids, extras in msg.rows():
                req = self._open.get(rid)
                if req is not None:  # else: aborted or finished here already; drop it
                    req.prompt_logprobs_received |= extras is not None and extras.prompt_logprobs is not None
                    req.queue.put_nowait(TokenOut.of_row(rid, token_ids, extras))
        elif isinstance(msg, SchedulerStats):
            if self._valid_replica(msg.dp_rank):
                self.replicas.stats[msg.dp_rank] = msg
        elif isinstance(msg, FlushCacheDone):
            if self._valid_replica(msg.dp_rank):
                self._on_flush_done(msg)
        elif isinstance(msg, ServerInfo):
            if not self._valid_replica(msg.dp_rank):
                return
            known = self.replicas.infos[msg.dp_rank]
            if known is not None and msg.boot_id == known.boot_id:
                return  # the same scheduler announcing itself and answering our hello
            self._on_scheduler_restart(msg)
        elif isinstance(msg, ServerHealth):
            self._on_health(msg)

    def _on_health(self, health: ServerHealth) -> None:
        """launch.py's word after a restart; while unhealthy (restart budget spent, a node
        missing) fail every open request with 503, and answer new ones so until healthy again."""
        self.metrics.restarts.inc(max(0, health.restarts - self.health.restarts))
        self.health = health
        if health.healthy:
            return
        logger.error(
            "server unavailable after %d restarts (%s): failing %d open requests",
            health.restarts,
            health.last_cause,
            len(self._open),
        )
        for req in self._open.values():
            req.queue.put_nowait(TokenOut(req.rid, [], "error", error=f"{SERVER_UNAVAILABLE}: {health.last_cause}"))

    def _on_scheduler_restart(self, info: ServerInfo) -> None:
        """A new ServerInfo means a new scheduler: resubmit every open request it had.

        Each goes back as a prefill of its prompt plus the tokens it already produced, with
        its budget reduced by those, so the client sees latency, not an error. The produced
        tokens also go as `resumed_ids`: they count towards min_new_tokens and its grammar.
        Prompt logprobs that already arrived are not asked for again.
        """
        check_protocol_version("the restarted scheduler", info.protocol_version)
        self.replicas.infos[info.dp_rank] = info
        lost = [r for r in self._open.values() if r.replica == info.dp_rank and not r.scheduler_done]
        logger.warning("scheduler of replica %d restarted: resubmitting %d open requests", info.dp_rank, len(lost))
        for req in lost:
            if req.embedding:
                self._send_soon(req.replica, self._embed_req(req))
                self.metrics.resumed_requests.inc()
                continue
            produced = len(req.generated)
            budget = req.sampling.max_new_tokens
            sp = msgspec.structs.replace(req.sampling, max_new_tokens=max(min(1, budget), budget - produced))
            if req.prompt_logprobs_received:
                sp = msgspec.structs.replace(sp, prompt_logprobs_from=-1, prompt_top_logprobs=0)
            ids, resumed = pack_int32(req.prompt_ids + req.generated), pack_int32(req.generated)
            salt, priority = req.scheduling.cache_salt, req.scheduling.priority
            self._send_soon(req.replica, GenerateReq(req.rid, ids, sp, resumed, info.boot_id, salt, priority))
            self.metrics.resumed_requests.inc()

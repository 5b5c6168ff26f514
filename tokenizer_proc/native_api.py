"""SGLang-style native routes: /generate, /abort, /flush_cache, /server_info, /get_model_info,
/health_generate; and vLLM's /version, /load and /reset_prefix_cache.

/generate streams SGLang's way: every event carries the *cumulative* `text` and
`output_ids` so far (not a delta), then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from tokenizer_proc.errors import APIError, error_response
from tokenizer_proc.openai_api import EventStreamResponse
from tokenizer_proc.prompt_logprobs_format import LogprobMeta
from tokenizer_proc.protocol import AbortRequest, GenerateRequest
from tokenizer_proc.request_handle import RequestHandle
from tokenizer_proc.sampling import check_prompt_ids, native_sampling_params
from tokenizer_proc.serving import (
    CLIENT_CLOSED,
    SSE_DONE,
    ChoiceResult,
    ClientDisconnected,
    collect,
    merge_outputs,
    sse,
    stream_error_event,
)
from tokenizer_proc.state import get_state
from tokenizer_proc.tokenization import encode_text
from trident.wire.frontend import SamplingParams

logger = logging.getLogger(__name__)
router = APIRouter()

HEALTH_GENERATE_TIMEOUT_S = 20.0
FLUSH_TIMEOUT_S = 30.0


def _meta(rid: str, r: ChoiceResult, logprobs: LogprobMeta | None = None) -> dict[str, Any]:
    meta = {
        "id": rid,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
        "finish_reason": r.finish_reason,
    }
    if logprobs is not None:
        meta.update(logprobs.fields(r))
    return meta


@router.post("/generate", response_model=None)
async def generate(body: GenerateRequest, request: Request) -> Response:
    st = get_state(request)
    if (body.text is None) == (body.input_ids is None):
        raise APIError("Give exactly one of `text` and `input_ids`.", param="text")
    param = "text" if body.text is not None else "input_ids"
    if body.text is not None:
        if not body.text:
            raise APIError("The prompt is empty.", param="text", code="empty_prompt")
        ids = encode_text(st.tokenizer, body.text)
    else:
        ids = list(body.input_ids or [])
    limits = st.limits
    check_prompt_ids(ids, limits, param)
    sp = body.sampling_params
    params = native_sampling_params(sp, len(ids), limits, param, body)
    logprob_meta = LogprobMeta(body, st.strings, ids) if body.return_logprob else None
    rid = body.rid or st.manager.new_rid("gen")
    handles = await st.manager.submit(
        ids,
        params,
        rids=[rid],
        text=sp.text_options(),
        stream=bool(body.stream),
    )
    if body.stream:
        return EventStreamResponse(_stream_generate(handles, rid, logprob_meta), handles)
    try:
        (result,) = await collect(request, handles)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    meta = _meta(rid, result, logprob_meta)
    return JSONResponse({"text": result.text, "output_ids": result.token_ids, "meta_info": meta})


async def _stream_generate(
    handles: Sequence[RequestHandle], rid: str, logprob_meta: LogprobMeta | None
) -> AsyncIterator[bytes]:
    result = ChoiceResult(0)
    async for out in merge_outputs(handles):
        result.add(out)
        if out.finish_reason == "error":
            yield stream_error_event(f"generation failed: {out.error or 'unknown error'}")
            break
        if out.text or out.token_ids or out.finish_reason is not None:
            meta = _meta(rid, result, logprob_meta)
            yield sse({"text": result.text, "output_ids": result.token_ids, "meta_info": meta})
    yield SSE_DONE


@router.post("/abort")
async def abort(body: AbortRequest, request: Request) -> dict[str, Any]:
    """Abort a request by the id the client saw (an OpenAI `id` aborts all its choices)."""
    return {"aborted": get_state(request).manager.abort(body.rid)}


@router.api_route("/flush_cache", methods=["GET", "POST"], response_model=None)
@router.post("/reset_prefix_cache", response_model=None)  # vLLM's name
async def flush_cache(request: Request) -> Response:
    done = await get_state(request).manager.flush_cache(FLUSH_TIMEOUT_S)
    if done.ok:
        return JSONResponse({"message": done.message or "cache flushed"})
    return error_response(done.message or "the cache could not be flushed", 400, code="flush_failed")


@router.get("/server_info")
@router.get("/get_server_info")  # SGLang's older name
async def server_info(request: Request) -> dict[str, Any]:
    st = get_state(request)
    out = msgspec.to_builtins(st.args)
    out.pop("api_key", None)
    out.pop("cluster_secret", None)
    mgr = st.manager
    out["scheduler_info"] = msgspec.structs.asdict(mgr.server_info) if mgr.server_info else None
    out["scheduler_stats"] = msgspec.structs.asdict(mgr.stats) if mgr.stats else None
    out["tokenizer_stats"] = {"open_requests": mgr.num_open, "dropped_frames": mgr.dropped_frames}
    replicas, router = mgr.replicas, mgr.replicas.router
    out["replicas"] = [
        {
            "dp_rank": d,
            "routed_requests": router.routed[d],
            "open_requests": router.open_requests[d],
            "scheduler_stats": msgspec.structs.asdict(replicas.stats[d]) if replicas.stats[d] else None,
            "worker_nodes": mgr.health.rank_nodes[d] if d < len(mgr.health.rank_nodes) else None,
        }
        for d in range(replicas.size)
    ]
    return out


@router.get("/get_model_info")
async def model_info(request: Request) -> dict[str, Any]:
    """SGLang's: what is served, from where."""
    st = get_state(request)
    return {
        "model_path": st.args.model_path,
        "tokenizer_path": st.args.tokenizer_source,
        "served_model_name": st.args.served_model_name,
        "is_generation": True,
    }


@router.get("/load")
async def load(request: Request) -> dict[str, int]:
    """vLLM's: the requests this server holds open (queued or running), for a load balancer."""
    return {"server_load": get_state(request).manager.num_open}


@router.get("/version")
async def version() -> dict[str, str]:
    """The installed package's version, as vLLM's GET /version answers it."""
    try:
        return {"version": importlib.metadata.version("trident")}
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that pip never installed
        return {"version": "unknown"}


@router.get("/health_generate", response_model=None)
async def health_generate(request: Request) -> Response:
    """One greedy token through tokenizer, scheduler and workers; 503 if it does not come back."""
    st = get_state(request)
    mgr = st.manager
    try:
        ids = encode_text(st.tokenizer, "Hello") or [0]
        params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        handles = await mgr.submit(ids, params, rids=[mgr.new_rid("health")], check_capacity=False)
        (result,) = await asyncio.wait_for(collect(None, handles), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        return error_response(f"no token within {HEALTH_GENERATE_TIMEOUT_S:g}s", 503, type_="server_error")
    except APIError as e:
        return error_response(e.message, 503, type_="server_error")
    if result.finish_reason not in ("stop", "length") or not result.token_ids:
        return error_response(f"health request ended with {result.finish_reason}", 503, type_="server_error")
    return Response(status_code=200)

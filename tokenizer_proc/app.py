"""The FastAPI application: routes, error handlers, and the front-door middleware.

`FrontDoorMiddleware` is plain ASGI (no BaseHTTPMiddleware, which would buffer streams
and hide disconnects). It enforces, before any route runs:
- the API key (`Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`; constant-time
  compare) on every path but /health, /ping and /metrics, when `--api-key` is set: else 401;
- the request body limit `max_request_body_bytes`: a larger Content-Length is refused at
  once, and a chunked body is counted as it is read: 413 either way.
Around it, Starlette's CORS middleware (also plain ASGI) answers browsers from
`--allowed-origins`.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenizer_proc import (
    embeddings_api,
    invocations_api,
    messages_api,
    native_api,
    openai_api,
    responses_api,
    tokenize_api,
)
from tokenizer_proc.errors import error_response, install_error_handlers
from tokenizer_proc.state import FrontendState, get_state

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})
"""Reachable without the API key (load balancers and Prometheus)."""


class FrontDoorMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None
        self._max_body = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        path = scope.get("path", "")
        if self._key is not None and path not in OPEN_PATHS and not self._key_given(headers):
            response = error_response(
                "Missing or invalid API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`).",
                401,
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
                path=path,
            )
            await response(scope, receive, send)
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self._max_body:
            await self._too_large(path)(scope, receive, send)
            return
        await self.app(scope, self._counting_receive(receive), send)

    def _key_given(self, headers: dict[bytes, bytes]) -> bool:
        assert self._key is not None
        bearer = headers.get(b"authorization", b"")
        return hmac.compare_digest(bearer, b"Bearer " + self._key) or hmac.compare_digest(
            headers.get(b"x-api-key", b""), self._key
        )

    def _too_large(self, path: str) -> Response:
        message = f"The request body is larger than {self._max_body} bytes."
        return error_response(message, 413, code="request_too_large", path=path)

    def _counting_receive(self, receive: Receive) -> Receive:
        seen = 0

        async def wrapped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self._max_body:
                    # FastAPI re-raises HTTPException from body parsing; our handler shapes it.
                    raise HTTPException(413, f"The request body is larger than {self._max_body} bytes.")
            return message

        return wrapped


def create_app(state: FrontendState) -> FastAPI:
    app = FastAPI(title="trident", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.frontend = state
    install_error_handlers(app)
    args = state.args
    app.add_middleware(FrontDoorMiddleware, api_key=args.api_key, max_body_bytes=args.max_request_body_bytes)
    if args.allowed_origins:
        # Added last, so outermost: a browser's preflight (OPTIONS, which carries no key) is
        # answered before the front door asks for the key.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=args.allowed_origins,
            allow_methods=args.allowed_methods,
            allow_headers=args.allowed_headers,
            allow_credentials=args.allow_credentials,
        )

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # SageMaker's health check, as vLLM answers it
    async def health(request: Request) -> Response:
        health = get_state(request).manager.health
        if health.healthy:
            return Response(status_code=200)
        # Why it is down (a missing node, a spent restart budget), for the operator's probe.
        return JSONResponse({"status": "unavailable", "reason": health.last_cause}, status_code=503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body = get_state(request).metrics.render()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(openai_api.router)
    app.include_router(native_api.router)
    app.include_router(tokenize_api.router)
    app.include_router(embeddings_api.router)
    app.include_router(responses_api.router)
    app.include_router(messages_api.router)
    app.include_router(invocations_api.router)
    return app

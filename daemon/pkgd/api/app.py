"""The ASGI application: FastAPI routes behind two small ASGI middlewares.

Outermost `LiveCORS` (Starlette's ``CORSMiddleware`` rebuilt when ``frontend.cors``
changes), then `GuardMiddleware`: the request body limit (``frontend.max_request_body_bytes``,
413) and deadline (``frontend.body_timeout``, 408: a client trickling its body cannot hold a
connection), Bearer API keys (``frontend.api_keys``, 401, compared in constant time with
`hmac.compare_digest`), ``X-Request-Id`` on every response (the client's, echoed, or the
request's id) and, while draining, ``Connection: close`` on every response.
Both read ``state.config`` on every request, so a SIGHUP reload of
these live fields needs no restart. The index (``/``), ``/health``, ``/ping``, ``/version``,
``/metrics`` and the OpenAPI docs (``/docs``) are open; everything else needs a key when keys
are configured (vLLM checks keys on ``/v1`` routes only; pkgd also guards its admin and
SageMaker ``/invocations`` routes).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pkgd.api import errors
from pkgd.api.routes import install_request_schemas, router
from pkgd.api.routes_admin import router as admin_router
from pkgd.api.routes_lora import router as lora_router
from pkgd.api.state import ServerState

OPEN_PATHS = frozenset(
    {"/", "/health", "/ping", "/version", "/metrics", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc"}
)


def build_app(state: ServerState, *, lifespan: Callable[[FastAPI], Any] | None = None) -> ASGIApp:
    """The ASGI app serving ``state`` (``lifespan`` starts and stops the engine client)."""
    app = FastAPI(
        title="pkgd",
        summary="OpenAI-compatible LLM serving (vLLM's API, run as a config-driven daemon)",
        lifespan=lifespan,
    )
    app.state.pkgd = state
    errors.install(app)
    app.include_router(router)
    app.include_router(admin_router)
    app.include_router(lora_router)
    install_request_schemas(app)
    return LiveCORS(GuardMiddleware(app, state), state)


async def _send_json(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _error(status: int, message: str, code: str | None = None) -> bytes:
    return json.dumps(errors.error_body(status, message, code=code)).encode()


class GuardMiddleware:
    """Body limit and API keys, before any parsing."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _echoing_request_id(_closing_when_draining(send, self.state), scope)
        f = self.state.config.frontend
        if f.api_keys and scope["path"] not in OPEN_PATHS and not self._authorized(scope, f.api_keys):
            await _send_json(
                send,
                401,
                _error(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", "invalid_api_key"),
                [(b"www-authenticate", b"Bearer")],
            )
            return
        limit = f.max_request_body_bytes
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _send_json(
                send,
                413,
                _error(413, f"request body of {length} bytes exceeds frontend.max_request_body_bytes ({limit})"),
                [(b"connection", b"close")],
            )  # the body is not read: the connection cannot go on
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            try:
                body = await asyncio.wait_for(_read_body(receive, limit), f.body_timeout)
            except TimeoutError:
                await _send_json(
                    send,
                    408,
                    _error(408, f"the request body did not arrive within frontend.body_timeout ({f.body_timeout:g} s)"),
                    [(b"connection", b"close")],
                )
                return
            if body is None:
                await _send_json(
                    send,
                    413,
                    _error(413, f"request body exceeds frontend.max_request_body_bytes ({limit})"),
                    [(b"connection", b"close")],
                )
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    @staticmethod
    def _authorized(scope: Scope, keys: list[Any]) -> bool:
        return bearer_authorized(_header(scope, b"authorization") or "", keys)


def bearer_authorized(header: str, keys: list[Any]) -> bool:
    """Whether an ``Authorization`` value (``Bearer <key>``) holds one of ``keys``
    (``SecretStr``s), compared in constant time (also the gRPC frontend's check)."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    given = token.strip().encode()
    ok = False
    for key in keys:  # no early exit: the time taken does not tell which key matched
        ok |= hmac.compare_digest(given, key.get_secret_value().encode())
    return ok


def _closing_when_draining(send: Send, state: ServerState) -> Send:
    """``send`` adding ``Connection: close`` to a response that starts while draining (also
    for requests that arrived before), so the client's next request opens a new connection,
    which another API server accepts, instead of racing this server's close."""

    async def closing_send(message: Message) -> None:
        if message["type"] == "http.response.start" and state.draining:
            headers = list(message.get("headers", []))
            if not any(k.lower() == b"connection" for k, _ in headers):
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return closing_send


def _echoing_request_id(send: Send, scope: Scope) -> Send:
    """``send`` adding ``X-Request-Id`` to the response: the client's header when it sent one
    (vLLM's ``--enable-request-id-headers``, always on), else the id a generation route gave
    the request (`pkgd.api.serving.request_id`, the response body's ``id``)."""
    given = _header(scope, b"x-request-id")

    async def echoing_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            rid = given if given is not None else scope.get("state", {}).get("request_id")
            headers = list(message.get("headers", []))
            if rid is not None and not any(k.lower() == b"x-request-id" for k, _ in headers):
                message = {**message, "headers": [*headers, (b"x-request-id", rid.encode("latin-1", "replace"))]}
        await send(message)

    return echoing_send


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None once it passes ``limit`` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            break  # disconnected; the app sees an empty body and the disconnect
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not msg.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Callable[[], Awaitable[Message]]:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # then the real channel: http.disconnect

    return replay


class LiveCORS:
    """Starlette's CORSMiddleware built from the current ``frontend.cors`` (none when no
    origin is allowed)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        self._cors_cfg: Any = None
        self._cors: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cfg = self.state.config.frontend.cors
        if cfg is not self._cors_cfg:
            self._cors_cfg = cfg
            self._cors = (
                CORSMiddleware(
                    self.app,
                    allow_origins=cfg.allowed_origins,
                    allow_credentials=cfg.allow_credentials,
                    allow_methods=cfg.allowed_methods,
                    allow_headers=cfg.allowed_headers,
                )
                if cfg.allowed_origins
                else None
            )
        await (self._cors or self.app)(scope, receive, send)

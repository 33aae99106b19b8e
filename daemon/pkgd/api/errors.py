"""OpenAI-shaped errors: every failure answers ``{"error": {"message", "type", "param",
"code"}}`` with a fitting status, and never takes the server down.

Status by cause: invalid body or values 400, missing/wrong API key 401, unknown model or
route 404, wrong method 405, body not received within ``frontend.body_timeout`` 408, an admin
call the engine cannot take now (requests still running) 409, body over
``frontend.max_request_body_bytes`` or text over ``frontend.limits.max_input_chars`` 413, a
JSON route's body not sent as JSON 415 (`require_json`), no engine core available or an engine
asleep 503 (with ``Retry-After``), a failure inside pkgd 500.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from pkgd import log
from pkgd.ipc.client import EngineRequestError, EngineUnavailableError
from pkgd.sampling_params import SamplingParams

logger = log.get_logger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error with its HTTP status; raise it anywhere in a route."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # pickled by keyword (a worker process raises it): Exception's default passes args only
        return (functools.partial(APIError, param=self.param, code=self.code), (self.status, self.message))


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}
    }


#: Seconds a 503 tells clients to wait (``Retry-After``): an engine core restarting or an API
#: server draining is back, or has handed over, within a few seconds.
RETRY_AFTER_S = 2


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    if status == 503:
        headers = {"Retry-After": str(RETRY_AFTER_S), **(headers or {})}
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status, headers=headers)


def sse_error(status: int, message: str) -> str:
    """An error as one SSE event, for a stream that already started."""
    return f"data: {json.dumps(error_body(status, message))}\n\n"


def is_json_media_type(content_type: str | None) -> bool:
    """``application/json`` or ``application/*+json``, parameters allowed (FastAPI's test)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    maintype, _, subtype = media.partition("/")
    return maintype == "application" and (subtype == "json" or subtype.endswith("+json"))


async def require_json(request: Request) -> None:  # async: FastAPI runs a sync one in a thread
    """The dependency of every route that takes a JSON body.

    A browser posts ``text/plain`` (or a form) to any origin without a CORS preflight, so a
    route that read such a body as JSON could be driven from any web page its users visit;
    a JSON content type needs the preflight, which ``frontend.cors`` answers.

    Raises:
        APIError: 415 when the Content-Type is missing or not JSON.
    """
    content_type = request.headers.get("content-type")
    if not is_json_media_type(content_type):
        got = f"got {content_type!r}" if content_type else "none was sent"
        raise APIError(
            415,
            f"the request body must be JSON sent with 'Content-Type: application/json' ({got})",
            code="unsupported_media_type",
        )


def from_value_error(exc: ValueError) -> APIError:
    """A 400 from a validation `ValueError`; ``param`` is the request field its message
    starts with, when it starts with one."""
    message = str(exc)
    first = message.split(" ", 1)[0].rstrip(":")
    return APIError(400, message, param=first if first in _PARAMS else None)


_PARAMS = {f.name for f in msgspec.structs.fields(SamplingParams)} | {
    "messages",
    "prompt",
    "model",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "echo",
}


def from_engine_error(exc: EngineRequestError | EngineUnavailableError) -> APIError:
    if isinstance(exc, EngineUnavailableError):
        return APIError(503, str(exc))
    return APIError(400 if exc.rejected else 503, str(exc))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if not loc:
        if msg == "Field required":
            return "the request body is missing", None
        head = msg.split(":", 1)[0]  # model-level checks start with the field they concern
        return msg, head if head.isidentifier() and head != msg else None
    field = ".".join(loc)
    got = err.get("input")
    suffix = f" (got {json.dumps(got)})" if isinstance(got, int | float | str | bool) else ""
    return f"{field}: {msg}{suffix}", loc[0]


def install(app: FastAPI) -> None:
    """Register the handlers that turn exceptions into OpenAI-shaped JSON."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(EngineUnavailableError)
    @app.exception_handler(EngineRequestError)
    async def _engine(request: Request, exc: Exception) -> JSONResponse:
        err = from_engine_error(exc)  # type: ignore[arg-type]
        return error_response(err.status, err.message)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request_failed", path=request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

"""vLLM's non-OpenAI routes: SageMaker's ``/ping`` and ``/invocations``, ``/tokenizer_info``
and the development routes (``/server_info``, ``/reset_prefix_cache``, sleep mode).

Gating follows vLLM: ``/tokenizer_info`` exists only with
``frontend.enable_tokenizer_info_endpoint`` (vLLM's ``--enable-tokenizer-info-endpoint``);
the development routes only with ``frontend.server_dev_mode`` (vLLM's
``VLLM_SERVER_DEV_MODE=1``), and ``/sleep`` / ``/wake_up`` act only on engines started with
``model.enable_sleep_mode``. A route that is off answers 404 as an unknown route does. Both
flags are read per request, so a reload turns them on or off. ``/ping`` is open like
``/health``; every other route here needs the API key when keys are configured (vLLM checks
keys on ``/v1`` only; pkgd is stricter, see `pkgd.api.app`).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import pydantic
from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import JSONResponse, Response

from pkgd.api import serving
from pkgd.api.errors import APIError, from_engine_error, require_json
from pkgd.api.preprocess import decode_body
from pkgd.api.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from pkgd.api.protocol_embeddings import EmbeddingRequest
from pkgd.api.protocol_score import ClassificationRequest, PoolingRequest, RerankRequest, ScoreRequest
from pkgd.api.serving_chat import create_chat_completion, render_in_worker
from pkgd.api.serving_classify import create_classify, create_pooling
from pkgd.api.serving_completion import create_completion, tokenize_in_worker
from pkgd.api.serving_embedding import create_embedding
from pkgd.api.serving_score import create_rerank, create_score
from pkgd.api.state import ServerState
from pkgd.ipc.client import EngineUnavailableError

if TYPE_CHECKING:
    from pkgd.config.sections import FrontendLimits

router = APIRouter()
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 503)}

# /invocations tries these in order (vLLM's order), among the ones the served model has: its
# runner, and for a pooling model whether it is a classifier ("classify") or embeds ("embed").
# The last item is the endpoint's share of a large body's work in the worker process (None: none).
_INVOCATIONS: list[
    tuple[type[pydantic.BaseModel], Callable[..., Awaitable[Any]], str, Callable[[Any, int], Any] | None]
] = [
    (ChatCompletionRequest, create_chat_completion, "generate", render_in_worker),
    (CompletionRequest, create_completion, "generate", tokenize_in_worker),
    (EmbeddingRequest, create_embedding, "embed", None),
    (ClassificationRequest, create_classify, "classify", None),
    (ScoreRequest, create_score, "pooling", None),
    (RerankRequest, create_rerank, "pooling", None),
    (PoolingRequest, create_pooling, "pooling", None),
]


def _state(request: Request) -> ServerState:
    return request.app.state.pkgd


def _not_found(request: Request) -> APIError:
    return APIError(404, f"no route {request.method} {request.url.path}")


@router.get("/ping", tags=["sagemaker"], responses={503: {"model": ErrorResponse}})
@router.post("/ping", tags=["sagemaker"], responses={503: {"model": ErrorResponse}}, operation_id="ping_post")
async def ping(request: Request) -> Response:
    """SageMaker's health check: 200 while an engine core serves, else 503 (as ``/health``)."""
    status, body = _state(request).health()
    if status != 200:
        return JSONResponse(
            {"error": {"message": body["status"], "type": "service_unavailable", "param": None, "code": None}},
            status_code=status,
        )
    return JSONResponse(body)


@router.post(
    "/invocations",
    tags=["sagemaker"],
    responses={**_ERRORS, 415: {"model": ErrorResponse}},
    dependencies=[Depends(require_json)],
)
async def invocations(request: Request) -> Any:
    """SageMaker's inference route: the body's shape picks the endpoint (chat ``messages``,
    completion ``prompt``, embedding or classification ``input``, score pairs, rerank
    ``query``/``documents``), as vLLM dispatches it. The body is parsed (and
    held to ``frontend.limits``) on the `Preprocessor`, never on the event loop; a large one in
    its worker process, with the endpoint's template and tokenization."""
    state = _state(request)
    state.check_ready()
    raw = await request.body()
    hs = state.llm.handshake
    runner: str = hs.runner if hs is not None else state.config.model.runner_type
    if runner == "pooling":
        runner = "classify" if hs is not None and hs.labels else "embed"
    limits = state.config.frontend.limits
    if state.preprocess.isolates(raw):
        dispatched = await state.preprocess.run_isolated(_dispatch, raw, limits, runner, serving.max_model_len(state))
    else:
        dispatched = await state.preprocess.run(_dispatch, raw, limits, runner)
    index, parsed, prepared = dispatched
    handler = _INVOCATIONS[index][1]
    return await (handler(request, state, parsed) if prepared is None else handler(request, state, parsed, prepared))


def _dispatch(
    raw: bytes, limits: FrontendLimits, runner: str, max_model_len: int | None = None
) -> tuple[int, Any, Any]:
    """The ``_INVOCATIONS`` index of the endpoint for an ``/invocations`` body, the body parsed
    for it and, given ``max_model_len`` (in the worker process), what that endpoint's worker
    function made of it (else None). Raises `APIError` 400 when no endpoint takes the body."""
    data = decode_body(raw, limits)
    kinds = {runner, "pooling"} if runner in ("embed", "classify") else {runner}
    candidates = [i for i, (_, _, needs, _) in enumerate(_INVOCATIONS) if needs in kinds]
    for i in candidates:
        model, _, _, in_worker = _INVOCATIONS[i]
        try:
            parsed = model.model_validate(data)
        except pydantic.ValidationError:
            continue
        prepared = in_worker(parsed, max_model_len) if in_worker is not None and max_model_len is not None else None
        return i, parsed, prepared
    names = ", ".join(_INVOCATIONS[i][0].__name__ for i in candidates)
    raise APIError(400, f"cannot find a handler for this request body; expected one of: {names}")


@router.get("/tokenizer_info", tags=["utilities"], responses=_ERRORS)
async def tokenizer_info(request: Request) -> Any:
    """The tokenizer's configuration and chat template, as vLLM returns them (what lm-eval's
    ``tokenizer_backend=remote`` reads: ``eos_token``, ``bos_token``, ``chat_template``)."""
    state = _state(request)
    if not state.config.frontend.enable_tokenizer_info_endpoint:
        raise _not_found(request)
    state.check_ready()
    tok = state.llm.tokenizer
    if tok is None:
        raise APIError(404, "this model has no tokenizer")
    info = {
        k: _json_able(v)
        for k, v in (getattr(tok, "init_kwargs", None) or {}).items()
        if not k.endswith("_file") and k != "name_or_path"
    }  # paths on this host
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if info.get(name) is None and getattr(tok, name, None) is not None:
            info[name] = str(getattr(tok, name))
    info["tokenizer_class"] = type(tok).__name__
    template = getattr(tok, "chat_template", None)  # model.chat_template when set (loaded with it)
    if template:
        info["chat_template"] = template
    return JSONResponse(info)


def _json_able(v: Any) -> Any:
    if hasattr(v, "content"):  # tokenizers' AddedToken
        return v.content
    if isinstance(v, dict):
        return {str(k): _json_able(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_json_able(x) for x in v]
    if v is None or isinstance(v, str | int | float | bool):
        return v
    return str(v)


# ---- development routes (frontend.server_dev_mode) ------------------------------------------


def _dev(request: Request) -> ServerState:
    state = _state(request)
    if not state.config.frontend.server_dev_mode:
        raise _not_found(request)
    return state


async def _utility(state: ServerState, method: str, args: dict | None = None) -> list[Any]:
    """Call ``method`` on every engine core; their results, or the first refusal as an error."""
    state.check_ready()
    try:
        results = await state.llm.client.call_utility(method, args)
    except EngineUnavailableError as exc:
        raise from_engine_error(exc) from None
    refused = next((r for r in results if r.error is not None), None)
    if refused is not None:
        raise APIError(refused.error_status or 400, refused.error)
    return [r.result for r in results]


@router.get("/server_info", tags=["dev"], responses=_ERRORS)
async def server_info(request: Request) -> Any:
    """The validated configuration (secrets redacted), pkgd's version and each engine's handshake."""
    state = _dev(request)
    try:
        version = importlib.metadata.version("pkgd")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    hs = state.llm.handshake
    engines = [{f: getattr(hs, f) for f in hs.__struct_fields__}] if hs is not None else []
    return JSONResponse({"vllm_config": state.config.to_json_dict(), "version": version, "engines": engines})


@router.post("/reset_prefix_cache", tags=["dev"], responses=_ERRORS)
async def reset_prefix_cache(request: Request) -> Any:
    """Empty every engine core's prefix cache; 409 while requests hold KV blocks."""
    results = await _utility(_dev(request), "reset_prefix_cache")
    if not all(results):
        raise APIError(
            409, "the prefix cache is in use by running requests and was not reset; retry when the engine is idle"
        )
    return JSONResponse({"reset": True})


@router.post("/sleep", tags=["dev"], responses=_ERRORS)
async def sleep(request: Request, level: int = Query(1)) -> Any:
    """Release the engines' KV cache and weights memory (``level`` 1 or 2, vLLM's meanings);
    needs ``model.enable_sleep_mode`` and an idle engine (else 400 / 409)."""
    await _utility(_dev(request), "sleep", {"level": level})
    return JSONResponse({"is_sleeping": True, "level": level})


@router.post("/wake_up", tags=["dev"], responses=_ERRORS)
async def wake_up(request: Request, tags: list[str] | None = Query(None)) -> Any:
    """Restore what ``/sleep`` released (``tags``: ``weights``, ``kv_cache``; default both)."""
    state = _dev(request)
    await _utility(state, "wake_up", {"tags": tags})
    return JSONResponse({"is_sleeping": any(await _utility(state, "is_sleeping"))})


@router.get("/is_sleeping", tags=["dev"], responses=_ERRORS)
async def is_sleeping(request: Request) -> Any:
    """Whether an engine core is asleep."""
    return JSONResponse({"is_sleeping": any(await _utility(_dev(request), "is_sleeping"))})

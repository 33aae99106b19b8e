"""The HTTP routes: OpenAI endpoints, tokenizer utilities and admin endpoints."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import JSONResponse, Response

from pkgd.api.errors import APIError, error_response, require_json
from pkgd.api.preprocess import parse_body
from pkgd.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pkgd.api.protocol_embeddings import EmbeddingRequest
from pkgd.api.protocol_responses import ResponsesRequest
from pkgd.api.protocol_score import ClassificationRequest, PoolingRequest, RerankRequest, ScoreRequest
from pkgd.api.serving import process
from pkgd.api.serving_chat import create_chat_completion
from pkgd.api.serving_classify import create_classify, create_pooling
from pkgd.api.serving_completion import create_completion
from pkgd.api.serving_embedding import create_embedding
from pkgd.api.serving_responses import create_response, retrieve_response
from pkgd.api.serving_score import create_rerank, create_score
from pkgd.api.state import ServerState

router = APIRouter()

_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)}
# the routes that take a JSON body: 415 unless it is sent as JSON (`require_json`)
_JSON_ERRORS = {**_ERRORS, 415: {"model": ErrorResponse}}
_JSON_BODY = [Depends(require_json)]
_SSE = {
    "text/event-stream": {"schema": {"type": "string", "description": "data: <chunk JSON> events, then data: [DONE]"}}
}


def get_state(request: Request) -> ServerState:
    return request.app.state.pkgd


def _body(model: type) -> dict[str, Any]:
    """OpenAPI ``requestBody`` of a route that parses its body itself (on the `Preprocessor`,
    not through FastAPI on the event loop); `install_request_schemas` adds the schema."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    }


REQUEST_MODELS = (
    CompletionRequest,
    ChatCompletionRequest,
    EmbeddingRequest,
    ResponsesRequest,
    ScoreRequest,
    RerankRequest,
    ClassificationRequest,
    PoolingRequest,
    TokenizeRequest,
    DetokenizeRequest,
)


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={**_JSON_ERRORS, 200: {"content": _SSE}},
    dependencies=_JSON_BODY,
    tags=["openai"],
    openapi_extra=_body(CompletionRequest),
)
async def completions(request: Request) -> Any:
    """Text completion (``stream: true`` answers server-sent events)."""
    return await create_completion(request, get_state(request))


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses={**_JSON_ERRORS, 200: {"content": _SSE}},
    dependencies=_JSON_BODY,
    tags=["openai"],
    openapi_extra=_body(ChatCompletionRequest),
)
async def chat_completions(request: Request) -> Any:
    """Chat completion with the model's chat template (``stream: true`` answers server-sent events)."""
    return await create_chat_completion(request, get_state(request))


@router.post(
    "/v1/embeddings",
    responses=_JSON_ERRORS,
    dependencies=_JSON_BODY,
    tags=["openai"],
    openapi_extra=_body(EmbeddingRequest),
)
async def embeddings(request: Request) -> Any:
    """Embeddings of strings or token ids (a model served with ``model.runner: pooling``)."""
    return await create_embedding(request, get_state(request))


def _pooling_route(paths: tuple[str, ...], body: type, doc: str, handler) -> None:
    """Register ``handler`` (one of the pooling endpoints vLLM serves) under each of ``paths``."""

    async def endpoint(request: Request) -> Any:
        return await handler(request, get_state(request))

    endpoint.__doc__ = doc
    for path in paths:
        router.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            responses=_JSON_ERRORS,
            dependencies=_JSON_BODY,
            tags=["vllm"],
            openapi_extra=_body(body),
            name=path.strip("/").replace("/", "_"),
        )


_pooling_route(
    ("/score", "/v1/score"),
    ScoreRequest,
    "Relevance scores of text pairs: a cross-encoder's (a one-output classifier) or the cosine "
    "similarity of an embedding model's vectors.",
    create_score,
)
_pooling_route(
    ("/rerank", "/v1/rerank", "/v2/rerank"),
    RerankRequest,
    "Documents ordered by relevance to a query (Jina / Cohere response shape).",
    create_rerank,
)
_pooling_route(("/classify",), ClassificationRequest, "Label probabilities of a sequence classifier.", create_classify)
_pooling_route(("/pooling",), PoolingRequest, "The raw pooled output of a pooling model.", create_pooling)


@router.post(
    "/v1/responses",
    responses={**_JSON_ERRORS, 200: {"content": _SSE}},
    dependencies=_JSON_BODY,
    tags=["openai"],
    openapi_extra=_body(ResponsesRequest),
)
async def responses(request: Request) -> Any:
    """OpenAI's Responses API over the chat template (``stream: true`` answers Responses events)."""
    return await create_response(request, get_state(request))


@router.get("/v1/responses/{response_id}", responses=_ERRORS, tags=["openai"])
async def get_response(response_id: str, request: Request) -> Any:
    """A response stored with ``store: true`` (``frontend.responses_store_size``)."""
    return await retrieve_response(response_id, get_state(request))


def _model_cards(state: ServerState) -> list[ModelCard]:
    hs = state.llm.handshake
    max_len = hs.max_model_len if hs is not None else None
    names = state.served_model_names()
    cards = [ModelCard(id=name, root=state.config.model.source, max_model_len=max_len) for name in names]
    # vLLM lists each adapter with its path as root and the base model as parent
    cards += [
        ModelCard(id=name, root=lora.lora_path, parent=lora.base_model_name or names[0], max_model_len=max_len)
        for name, lora in state.loras.items()
    ]
    return cards


@router.get("/v1/models", response_model=ModelList, tags=["openai"])
async def models(request: Request) -> Any:
    """The served model names."""
    return JSONResponse(ModelList(data=_model_cards(get_state(request))).model_dump())


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS, tags=["openai"])
async def model(model_id: str, request: Request) -> Any:
    """One served model (404, OpenAI-shaped, for a name that is not served)."""
    state = get_state(request)
    card = next((c for c in _model_cards(state) if c.id == model_id), None)
    if card is None:
        raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
    return JSONResponse(card.model_dump())


@router.post(
    "/tokenize",
    response_model=TokenizeResponse,
    responses=_JSON_ERRORS,
    dependencies=_JSON_BODY,
    tags=["utilities"],
    openapi_extra=_body(TokenizeRequest),
)
async def tokenize(request: Request) -> Any:
    """Token ids of a prompt, or of chat messages under the chat template."""
    state = get_state(request)
    state.check_ready()
    return await state.preprocess.run(_tokenize, state, await request.body())


def _tokenize(state: ServerState, raw: bytes) -> JSONResponse:
    body = parse_body(raw, TokenizeRequest, state.config.frontend.limits)
    state.resolve_model(body.model)
    if body.messages is not None:
        messages = [m.template_dict() for m in body.messages]
        text = process(state, lambda ip: ip.render_chat(messages, add_generation_prompt=body.add_generation_prompt))
        tokens = process(state, lambda ip: ip.tokenize(text, add_special_tokens=False))
    else:
        tokens = process(state, lambda ip: ip.tokenize(body.prompt or "", add_special_tokens=body.add_special_tokens))
    ip = state.llm.input_processor
    assert ip is not None  # check_ready(): a ready engine has one
    return JSONResponse(TokenizeResponse(count=len(tokens), max_model_len=ip.max_model_len, tokens=tokens).model_dump())


@router.post(
    "/detokenize",
    response_model=DetokenizeResponse,
    responses=_JSON_ERRORS,
    dependencies=_JSON_BODY,
    tags=["utilities"],
    openapi_extra=_body(DetokenizeRequest),
)
async def detokenize(request: Request) -> Any:
    """Text of token ids."""
    state = get_state(request)
    state.check_ready()
    return await state.preprocess.run(_detokenize, state, await request.body())


def _detokenize(state: ServerState, raw: bytes) -> JSONResponse:
    body = parse_body(raw, DetokenizeRequest, state.config.frontend.limits)
    state.resolve_model(body.model)
    ip = state.llm.input_processor
    assert ip is not None  # check_ready(): a ready engine has one
    vocab = ip.vocab_size
    bad = next((t for t in body.tokens if vocab is not None and t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of range [0, {vocab})", param="tokens")
    return JSONResponse({"prompt": state.llm.tokenizer.decode(body.tokens)})


def install_request_schemas(app: Any) -> None:
    """Add the request bodies' schemas to the app's OpenAPI document (see `_body`)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        doc = build()
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in REQUEST_MODELS:
            if model.__name__ not in schemas:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
        return doc

    app.openapi = openapi


@router.get("/health", tags=["admin"], responses={503: {"model": ErrorResponse}})
async def health(request: Request) -> Response:
    """200 while an engine core serves; 503 while draining or with no engine core."""
    status, body = get_state(request).health()
    if status != 200:
        return error_response(status, body["status"])
    return JSONResponse(body)


def _version() -> str:
    try:
        return importlib.metadata.version("pkgd")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@router.get("/", tags=["admin"])
async def index(request: Request) -> Any:
    """What answers here and where to go next: name, version, the served model names (left
    out when API keys are configured: this page is open, ``/v1/models`` is not) and links."""
    state = get_state(request)
    body: dict[str, Any] = {"name": "pkgd", "version": _version()}
    if state.config.frontend.api_keys:
        body["authentication"] = "send 'Authorization: Bearer <key>' to /v1/*"
    else:
        body["models"] = state.served_model_names()
    body["links"] = {
        "docs": "/docs",
        "models": "/v1/models",
        "health": "/health",
        "metrics": "/metrics",
        "version": "/version",
        "openapi": "/openapi.json",
    }
    return JSONResponse(body)


@router.get("/version", tags=["admin"])
async def version() -> Any:
    """pkgd's version."""
    return JSONResponse({"version": _version()})


@router.get("/metrics", tags=["admin"])
async def metrics(request: Request) -> Response:
    """Prometheus exposition (vLLM's metric names); the daemon's totals across API servers.
    Empty with ``logging.log_stats: false`` (vLLM's --disable-log-stats)."""
    state = get_state(request)
    if state.metrics is None:
        return Response(b"", media_type="text/plain; version=0.0.4; charset=utf-8")
    data, content_type = state.metrics.render(state.engine_collector)
    return Response(data, media_type=content_type)

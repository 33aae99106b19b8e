"""``POST /v1/embeddings``: one pooled vector per input (a string, a list of strings, token
ids, or a list of token-id lists), for a model served with ``model.runner: pooling``.

Every input of a request goes to the engine at once, so they are batched with each other and
with other clients' requests (continuous batching); the answer lists them in input order.
``encoding_format: base64`` sends each vector's float32 bytes as the engine produced them.
A model served for generation answers 400, as vLLM does. The body is parsed, checked against
``frontend.limits`` and tokenized off the event loop, as for chat and completions.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import TYPE_CHECKING, Any

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pkgd.api import serving
from pkgd.api.errors import APIError, from_engine_error
from pkgd.api.preprocess import parse_body
from pkgd.api.protocol_embeddings import EmbeddingRequest
from pkgd.ipc.client import EngineRequestError, EngineUnavailableError
from pkgd.pooling_params import PoolingParams

if TYPE_CHECKING:
    from pkgd.api.state import ServerState
    from pkgd.outputs import PoolingRequestOutput


async def create_embedding(request: Request, state: ServerState, parsed: EmbeddingRequest | None = None) -> Any:
    """Answer one embeddings request. Parsing, tokenization and building the response (a
    list of floats per vector) run on the `Preprocessor`, never on the event loop (a large body
    is parsed in its worker process).
    ``parsed``: the body, already parsed there (``/invocations``)."""
    state.check_ready()
    rid = serving.request_id("embd", request)
    raw = await request.body() if parsed is None else b""
    if parsed is None:
        parsed = await state.preprocess.parse_large(raw, EmbeddingRequest, state.config.frontend.limits)
    body, model, processed = await state.preprocess.run(_prepare, state, raw, rid, parsed)
    try:
        outs = await serving.run_until_disconnected(request, encode_all(state, processed))
    except serving.ClientDisconnected:
        return Response(status_code=499)
    return await state.preprocess.run(_response, body, rid, model, processed, outs)


def _prepare(
    state: ServerState, raw: bytes, rid: str, parsed: EmbeddingRequest | None
) -> tuple[EmbeddingRequest, str, list]:
    body = parsed if parsed is not None else parse_body(raw, EmbeddingRequest, state.config.frontend.limits)
    model = state.resolve_model(body.model)
    serving.require_runner(state, "pooling", "Embeddings API")
    if state.llm.handshake is not None and state.llm.handshake.labels:
        raise APIError(
            400,
            "this model does not support the Embeddings API: it is a sequence classifier; use /classify, /score, "
            "/rerank or /pooling",
        )
    params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
    if body.user is not None:  # OpenAI's end-user id: on this request's log lines
        structlog.contextvars.bind_contextvars(user=body.user)
    processed = []
    inputs = body.inputs()
    for i, prompt in enumerate(inputs):
        try:
            # process() calls the lambda at once, so it sees this iteration's i and prompt
            processed.append(
                serving.process(
                    state,
                    lambda ip: ip.process_pooling(
                        f"{rid}-{i}",
                        prompt,
                        params,
                        truncate_prompt_tokens=body.truncate_prompt_tokens,
                        add_special_tokens=body.add_special_tokens,
                        priority=body.priority,
                    ),
                )
            )
        except APIError as exc:
            if len(inputs) == 1:
                raise
            raise APIError(exc.status, f"input[{i}]: {exc.message}", param="input") from None
    return body, model, processed


def _response(
    body: EmbeddingRequest, rid: str, model: str, processed: list, outs: list[PoolingRequestOutput]
) -> JSONResponse:
    data = [
        {"object": "embedding", "index": i, "embedding": _encode_vector(out, body.encoding_format)}
        for i, out in enumerate(outs)
    ]
    num_tokens = sum(len(p.prompt_token_ids) for p in processed)
    return JSONResponse(
        {
            "id": rid,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0},
        }
    )


async def encode_all(state: ServerState, processed: list) -> list[PoolingRequestOutput]:
    """Every input at once; the first failure cancels the rest (their engine requests are
    aborted) and becomes the response's error."""
    timeout = state.config.frontend.request_timeout
    tasks = [asyncio.ensure_future(state.llm.encode(p, timeout=timeout)) for p in processed]
    try:
        return list(await asyncio.gather(*tasks))
    except (EngineRequestError, EngineUnavailableError) as exc:
        raise from_engine_error(exc) from None
    except TimeoutError:
        raise APIError(
            503, f"the request ran longer than frontend.request_timeout ({timeout} s) and was aborted"
        ) from None
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _encode_vector(out: PoolingRequestOutput, encoding_format: str) -> list[float] | str:
    data = out.outputs.data  # float32 little-endian, as the engine sent it
    if encoding_format == "base64":
        return base64.b64encode(data.tobytes()).decode("ascii")
    return data.tolist()

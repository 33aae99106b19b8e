"""``/classify`` and ``/pooling`` (vLLM's routes) for a model served with ``model.runner:
pooling``.

``/classify`` needs a sequence classifier: one ``{index, label, probs, num_classes}`` per
input, ``probs`` the softmax of its logits (sigmoid for one output; ``use_activation:
false`` gives the logits) and ``label`` the name of the largest. ``/pooling`` answers the
raw pooled output of any pooling model: an embedding model's vector (``normalize``,
``dimensions`` as for embeddings) or a classifier's probabilities (``use_activation``), as a
list of floats or, with ``encoding_format: base64``, their float32 little-endian bytes.
Inputs are those of ``/v1/embeddings`` (text, token ids, or lists of either); they run as
one batch, and the work off the event loop, as there.
"""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pkgd.api import serving
from pkgd.api.errors import APIError
from pkgd.api.preprocess import parse_body
from pkgd.api.protocol_score import ClassificationRequest, PoolingRequest
from pkgd.api.serving_embedding import encode_all
from pkgd.api.serving_score import require_classifier
from pkgd.frontend.pooling import activate
from pkgd.pooling_params import PoolingParams

if TYPE_CHECKING:
    from pkgd.api.state import ServerState
    from pkgd.frontend.input_processor import InputProcessor, ProcessedRequest
    from pkgd.outputs import PoolingRequestOutput


async def create_classify(request: Request, state: ServerState, parsed: ClassificationRequest | None = None) -> Any:
    """Answer one classification request (vLLM's ``ClassificationResponse``). ``parsed``: the
    body, already parsed (``/invocations``)."""
    return await _handle(request, state, "classify", ClassificationRequest, parsed)


async def create_pooling(request: Request, state: ServerState, parsed: PoolingRequest | None = None) -> Any:
    """Answer one pooling request (vLLM's ``PoolingResponse``). ``parsed`` as for `create_classify`."""
    return await _handle(request, state, "pool", PoolingRequest, parsed)


async def _handle(
    request: Request, state: ServerState, prefix: str, model_cls: type, parsed: ClassificationRequest | None
) -> Any:
    state.check_ready()
    rid = serving.request_id(prefix, request)
    raw = await request.body() if parsed is None else b""
    body, model, labels, processed = await state.preprocess.run(_prepare, state, raw, rid, model_cls, parsed)
    try:
        outs = await serving.run_until_disconnected(request, encode_all(state, processed))
    except serving.ClientDisconnected:
        return Response(status_code=499)
    return await state.preprocess.run(_response, body, rid, model, labels, processed, outs)


def _prepare(
    state: ServerState, raw: bytes, rid: str, model_cls: type, parsed: ClassificationRequest | None
) -> tuple[ClassificationRequest, str, list[str] | None, list[ProcessedRequest]]:
    body = parsed if parsed is not None else parse_body(raw, model_cls, state.config.frontend.limits)
    model = state.resolve_model(body.model)
    pooling = isinstance(body, PoolingRequest)
    serving.require_runner(state, "pooling", "Pooling API" if pooling else "Classification API")
    hs = state.llm.handshake
    labels = hs.labels if hs is not None else None
    if not pooling:
        labels = require_classifier(state, "Classification API")
    params = PoolingParams()
    if isinstance(body, PoolingRequest):
        if labels and (body.normalize is not None or body.dimensions is not None):
            field = "normalize" if body.normalize is not None else "dimensions"
            raise APIError(
                400,
                f"{field} applies to an embedding model; this model is a classifier (see use_activation)",
                param=field,
            )
        if not labels and any(v is not None for v in (body.use_activation, body.activation, body.softmax)):
            raise APIError(
                400,
                "use_activation applies to a classifier; this model computes embeddings (see normalize)",
                param="use_activation",
            )
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
    if body.user is not None:
        structlog.contextvars.bind_contextvars(user=body.user)
    inputs = body.inputs()
    processed = []
    for i, prompt in enumerate(inputs):

        def build(ip: InputProcessor, i: int = i, prompt: str | list[int] = prompt) -> ProcessedRequest:
            return ip.process_pooling(
                f"{rid}-{i}",
                prompt,
                params,
                truncate_prompt_tokens=body.truncate_prompt_tokens,
                add_special_tokens=body.add_special_tokens,
                priority=body.priority,
            )

        try:
            processed.append(serving.process(state, build))
        except APIError as exc:
            if len(inputs) == 1:
                raise
            raise APIError(exc.status, f"input[{i}]: {exc.message}", param="input") from None
    return body, model, labels, processed


def _response(
    body: ClassificationRequest,
    rid: str,
    model: str,
    labels: list[str] | None,
    processed: list[ProcessedRequest],
    outs: list[PoolingRequestOutput],
) -> JSONResponse:
    data: list[dict[str, Any]] = []
    for i, out in enumerate(outs):
        vec = out.outputs.data
        if labels and body.wants_activation():
            vec = activate(vec)
        if isinstance(body, PoolingRequest):
            enc: Any = (
                base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
                if body.encoding_format == "base64"
                else vec.tolist()
            )
            data.append({"index": i, "object": "pooling", "data": enc})
        else:
            assert labels is not None  # require_classifier
            data.append(
                {"index": i, "label": labels[int(np.argmax(vec))], "probs": vec.tolist(), "num_classes": len(labels)}
            )
    n = sum(len(p.prompt_token_ids) for p in processed)
    return JSONResponse(
        {
            "id": rid,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0},
        }
    )

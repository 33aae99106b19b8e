"""``/score`` (``/v1/score``) and ``/rerank`` (``/v1/rerank``, ``/v2/rerank``): relevance of
text pairs, for a model served with ``model.runner: pooling``, the two ways vLLM scores:

* **cross-encoder** — a sequence classifier with one output (``*ForSequenceClassification``
  with ``num_labels: 1``, or a Qwen3-Reranker served by the ``classifier_from_token``
  convention): each pair is tokenized as the tokenizer joins a text pair (or, with the model's
  ``use_sep_token: false``, as the concatenation of the two texts) and run as one prompt; the
  score is the sigmoid of its logit (``use_activation: false``: the logit);
* **bi-encoder** — an embedding model: every text is embedded once, and a pair's score is
  the cosine similarity of its two vectors (Reimers & Gurevych, 2019, Sentence-BERT).

Every prompt of a request goes to the engine at once (batched with each other and with other
clients' requests); parsing, tokenizing and building the answer run on the `Preprocessor`,
off the event loop, as for embeddings. Errors are OpenAI-shaped 400s (a generating model,
a classifier with more than one output, empty or mismatched lists), never 5xx.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pkgd.api import serving
from pkgd.api.errors import APIError
from pkgd.api.preprocess import parse_body
from pkgd.api.protocol_score import RerankRequest, ScoreRequest
from pkgd.api.serving_embedding import encode_all
from pkgd.frontend.pooling import activate, cosine, pair_index
from pkgd.pooling_params import PoolingParams

if TYPE_CHECKING:
    from pkgd.api.state import ServerState
    from pkgd.frontend.input_processor import ProcessedRequest
    from pkgd.outputs import PoolingRequestOutput


def require_classifier(state: ServerState, api: str) -> list[str]:
    """The served classifier's labels; a 400 when the model is not one."""
    labels = state.llm.handshake.labels if state.llm.handshake is not None else None
    if not labels:
        raise APIError(
            400,
            f"this model does not support the {api}: it is not a sequence classifier (a *ForSequenceClassification "
            "architecture, or model.convert: classify); it computes embeddings",
        )
    return labels


@dataclasses.dataclass
class ScorePlan:
    """The engine prompts of a score or rerank request and how their outputs become one
    score per pair (pair ``i``: ``first[0 if len(first) == 1 else i]`` with ``second[i]``)."""

    processed: list[ProcessedRequest]
    cross: bool  # a cross-encoder: one prompt per pair; else embeddings of each text
    num_first: int  # bi-encoder: processed[:num_first] embed the first side, the rest the second
    activation: bool

    def scores(self, outs: list[PoolingRequestOutput]) -> list[float]:
        if self.cross:
            return [float(activate(o.outputs.data)[0] if self.activation else o.outputs.data[0]) for o in outs]
        first, second = outs[: self.num_first], outs[self.num_first :]
        pairs = pair_index(len(first), len(second))
        return [cosine(first[j].outputs.data, b.outputs.data) for j, b in zip(pairs, second, strict=True)]

    def num_tokens(self) -> int:
        return sum(len(p.prompt_token_ids) for p in self.processed)


def plan_scores(
    state: ServerState,
    rid: str,
    first: list[str],
    second: list[str],
    body: ScoreRequest | RerankRequest,
    names: tuple[str, str],
) -> ScorePlan:
    """Tokenize the pairs of ``first`` x ``second`` into engine requests (`ScorePlan`);
    ``names``: the two sides' field names, for the messages. Raises `APIError` 400."""
    serving.require_runner(state, "pooling", "Score API")
    if not second:
        raise APIError(400, f"{names[1]} must not be empty", param=names[1])
    if len(first) not in (1, len(second)):
        raise APIError(
            400,
            f"{names[0]} has {len(first)} texts and {names[1]} {len(second)}: give one {names[0]} text, or as "
            f"many as {names[1]} (scored pairwise)",
            param=names[0],
        )
    if not first:
        raise APIError(400, f"{names[0]} must not be empty", param=names[0])
    limit = state.config.frontend.limits.max_prompts
    if len(second) > limit:
        raise APIError(
            400, f"{len(second)} pairs exceed frontend.limits.max_prompts ({limit})", param=names[1], code="max_prompts"
        )
    if body.user is not None:
        structlog.contextvars.bind_contextvars(user=body.user)
    labels = state.llm.handshake.labels if state.llm.handshake is not None else None
    kw = {"truncate_prompt_tokens": body.truncate_prompt_tokens, "priority": body.priority}
    processed: list[ProcessedRequest] = []
    if labels:
        if len(labels) != 1:
            raise APIError(
                400,
                f"this classifier has {len(labels)} outputs ({', '.join(labels)}); scoring needs a model with one "
                "(num_labels: 1): use /classify for label probabilities",
            )
        sep = state.llm.handshake.use_sep_token if state.llm.handshake is not None else True
        for i, b in enumerate(second):
            a = first[0 if len(first) == 1 else i]
            processed.append(
                _one(
                    state,
                    len(second),
                    i,
                    names[1],
                    lambda ip, a=a, b=b, i=i: ip.process_pooling(
                        f"{rid}-{i}", ip.tokenize_pair(a, b) if sep else ip.tokenize(a + b), PoolingParams(), **kw
                    ),
                )
            )
        return ScorePlan(processed, True, 0, body.wants_activation())
    if any(v is not None for v in (body.use_activation, body.activation, body.softmax)):
        raise APIError(
            400,
            "use_activation applies to a cross-encoder (a sequence classifier); this model scores by the cosine "
            "similarity of its embeddings",
            param="use_activation",
        )
    texts = [(names[0], t) for t in first] + [(names[1], t) for t in second]
    for i, (name, text) in enumerate(texts):
        processed.append(
            _one(
                state,
                2,
                i if name == names[0] else i - len(first),
                name,
                lambda ip, text=text, i=i: ip.process_pooling(f"{rid}-{i}", text, PoolingParams(normalize=True), **kw),
            )
        )
    return ScorePlan(processed, False, len(first), True)


def _one(state: ServerState, count: int, index: int, name: str, build) -> ProcessedRequest:
    try:
        return serving.process(state, build)
    except APIError as exc:
        if count == 1:
            raise
        raise APIError(exc.status, f"{name}[{index}]: {exc.message}", param=name) from None


async def _run(request: Request, state: ServerState, plan: ScorePlan) -> list[PoolingRequestOutput] | None:
    try:
        return await serving.run_until_disconnected(request, encode_all(state, plan.processed))
    except serving.ClientDisconnected:
        return None


async def create_score(request: Request, state: ServerState, parsed: ScoreRequest | None = None) -> Any:
    """Answer one score request (vLLM's ``ScoreResponse``: one ``score`` per pair).
    ``parsed``: the body, already parsed (``/invocations``)."""
    state.check_ready()
    rid = serving.request_id("score", request)
    raw = await request.body() if parsed is None else b""
    model, plan = await state.preprocess.run(_prepare_score, state, raw, rid, parsed)
    outs = await _run(request, state, plan)
    if outs is None:
        return Response(status_code=499)
    return await state.preprocess.run(_score_response, rid, model, plan, outs)


def _prepare_score(state: ServerState, raw: bytes, rid: str, parsed: ScoreRequest | None) -> tuple[str, ScorePlan]:
    body = parsed if parsed is not None else parse_body(raw, ScoreRequest, state.config.frontend.limits)
    model = state.resolve_model(body.model)
    names = body.pair_names()
    return model, plan_scores(state, rid, *body.pair(), body, names)


def _score_response(rid: str, model: str, plan: ScorePlan, outs: list[PoolingRequestOutput]) -> JSONResponse:
    n = plan.num_tokens()
    return JSONResponse(
        {
            "id": rid,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(plan.scores(outs))],
            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0},
        }
    )


async def create_rerank(request: Request, state: ServerState, parsed: RerankRequest | None = None) -> Any:
    """Answer one rerank request: the documents by relevance to the query, most relevant
    first, ``top_n`` of them (the Jina / Cohere shape vLLM answers with). ``parsed``: the
    body, already parsed (``/invocations``)."""
    state.check_ready()
    rid = serving.request_id("rerank", request)
    raw = await request.body() if parsed is None else b""
    body, model, plan = await state.preprocess.run(_prepare_rerank, state, raw, rid, parsed)
    outs = await _run(request, state, plan)
    if outs is None:
        return Response(status_code=499)
    return await state.preprocess.run(_rerank_response, body, rid, model, plan, outs)


def _prepare_rerank(
    state: ServerState, raw: bytes, rid: str, parsed: RerankRequest | None
) -> tuple[RerankRequest, str, ScorePlan]:
    body = parsed if parsed is not None else parse_body(raw, RerankRequest, state.config.frontend.limits)
    model = state.resolve_model(body.model)
    return body, model, plan_scores(state, rid, [body.query], body.texts(), body, ("query", "documents"))


def _rerank_response(
    body: RerankRequest, rid: str, model: str, plan: ScorePlan, outs: list[PoolingRequestOutput]
) -> JSONResponse:
    scores = plan.scores(outs)
    texts = body.texts()
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep document order
    if body.top_n:
        order = order[: body.top_n]
    results: list[dict[str, Any]] = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            item["document"] = {"text": texts[i]}
        results.append(item)
    n = plan.num_tokens()
    return JSONResponse(
        {"id": rid, "model": model, "usage": {"prompt_tokens": n, "total_tokens": n}, "results": results}
    )

"""The ``VllmEngine`` gRPC service (``smg-grpc-proto``'s ``vllm_engine.proto``) over the API
server's `AsyncLLM`: the same engine cores, limits and live config as the HTTP routes.

The router in front (the Shepherd Model Gateway, ``smg``) tokenizes, applies the chat
template, parses tool calls and detokenizes itself; it sends token ids and gets token ids
back. What it needs to do so without a model hub comes from `GetTokenizer` (the tokenizer
files as a zip archive) and `GetModelInfo`.

Errors are status codes, never a broken stream: a bad field is INVALID_ARGUMENT naming it; a
model that cannot do what is asked (Generate on a pooling model, Embed on a generating one)
UNIMPLEMENTED; no engine core, or a draining server, UNAVAILABLE (a router retries
elsewhere); ``frontend.request_timeout`` DEADLINE_EXCEEDED; a ``request_id`` already in
flight ALREADY_EXISTS. `Abort` ends the named Generate streams with a final ``complete``
whose ``finish_reason`` is ``abort``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import hashlib
import io
import json
import time
import uuid
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from pkgd import __version__, log
from pkgd.api import grpc_convert as convert
from pkgd.api.errors import APIError
from pkgd.frontend.async_llm import RequestAborted, RequestIdInUse
from pkgd.ipc.client import EngineRequestError, EngineUnavailableError
from pkgd.pooling_params import PoolingParams

if TYPE_CHECKING:
    from pkgd.api.state import ServerState
    from pkgd.frontend.input_processor import InputProcessor, ProcessedRequest

logger = log.get_logger(__name__)

TOKENIZER_CHUNK_BYTES = 64 * 1024  # the router's gRPC message budget per chunk
# What a router needs to build the tokenizer and render chats (HF's tokenizer files, and
# config.json / generation_config.json for the model type and EOS ids).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "config.json",
    "generation_config.json",
)

_HTTP_TO_GRPC = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


class Unsupported(Exception):
    """What the served model cannot do (Generate on a pooling model, Embed on a generating
    one): UNIMPLEMENTED, as vLLM answers a method its model has no runner for."""


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status for what a request raised (INTERNAL only for a bug)."""
    if isinstance(exc, Unsupported):
        return grpc.StatusCode.UNIMPLEMENTED, str(exc)
    if isinstance(exc, RequestIdInUse):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    if isinstance(exc, ValueError):  # RequestFieldError, InputProcessor's checks, verify()
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, APIError):
        return _HTTP_TO_GRPC.get(exc.status, grpc.StatusCode.INTERNAL), exc.message
    if isinstance(exc, EngineUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, EngineRequestError):
        return (grpc.StatusCode.INVALID_ARGUMENT if exc.rejected else grpc.StatusCode.UNAVAILABLE), str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "the request ran longer than frontend.request_timeout"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """``VllmEngine`` over ``state`` (one API-server process's `ServerState`)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.started = time.time()
        self.last_receive = 0.0
        self._tokenizer_zip: asyncio.Task[tuple[bytes, str]] | None = None

    # ---- generation ------------------------------------------------------------------------

    async def Generate(  # noqa: N802 - the proto's method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.last_receive = time.time()
        try:
            processed = await self._prepare(request)
        except Exception as exc:
            await self._abort(context, exc, request.request_id)
            return
        stream = request.stream
        first: set[int] = set()
        last: dict[int, Any] = {}  # index -> (output, completion) most recently sent
        try:
            async for out in self.state.llm.generate(processed, timeout=self.state.config.frontend.request_timeout):
                for completion in out.outputs:
                    last[completion.index] = (out, completion)
                    if stream:
                        yield convert.chunk(out, completion, first=completion.index not in first)
                        first.add(completion.index)
                    if completion.finish_reason and (stream or out.finished):
                        yield convert.complete(out, completion)
        except RequestAborted:
            # Abort RPC: every completion not finished yet ends with finish_reason "abort"
            for out, completion in last.values():
                if not completion.finish_reason:
                    yield convert.complete(out, _emptied(completion) if stream else completion, finish_reason="abort")
            if not last:
                yield _aborted(processed)
        except Exception as exc:
            await self._abort(context, exc, processed.request_id)

    async def _prepare(self, request: pb.GenerateRequest) -> ProcessedRequest:
        state = self.state
        state.check_ready()
        ip = _input_processor(state)
        if state.llm.handshake is not None and state.llm.handshake.runner != "generate":
            raise Unsupported("this model is served as a pooling model (model.runner: pooling): use Embed")
        dp = request.data_parallel_rank if request.HasField("data_parallel_rank") else None
        if dp is not None and not (dp == 0 and state.config.serve_plan().dp_size == 1):
            raise convert.RequestFieldError(
                "data_parallel_rank: pkgd balances requests over its DP ranks itself; leave it unset"
            )
        rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
        cfg = state.config
        prompt = convert.prompt_input(request, cfg.frontend.limits.max_input_chars)
        params = convert.sampling_params(
            request.sampling_params,
            stream=request.stream,
            limits=cfg.frontend.limits,
            generation=cfg.model.generation,
            file_defaults=state.llm.generation_defaults,
        )

        def build() -> ProcessedRequest:  # on the preprocessing threads: tokenizing, a schema's check
            if params.structured_outputs is not None:
                state.constraints.check_blocking(
                    params.structured_outputs, "sampling_params", max_bytes=cfg.frontend.limits.max_constraint_bytes
                )
            ids = ip.tokenize(prompt) if isinstance(prompt, str) else prompt
            return ip.process(rid, convert.truncate(ids, request.sampling_params, ip.max_model_len), params)

        return await state.preprocess.run(build)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:  # noqa: N802
        self.state.llm.abort([rid for rid in request.request_ids if rid])
        return pb.AbortResponse()

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:  # noqa: N802
        self.last_receive = time.time()
        state = self.state
        try:
            state.check_ready()
            hs = state.llm.handshake
            if hs is not None and hs.runner != "pooling":
                raise Unsupported(
                    "this model is served for generation (model.runner: generate); an embedding model needs "
                    "model.runner: pooling (--runner pooling)"
                )
            if hs is not None and hs.labels:  # a classifier's pooled output is its logits, not an embedding
                raise Unsupported("this model is a sequence classifier, not an embedding model")
            ip = _input_processor(state)
            ids = convert.prompt_input(request, state.config.frontend.limits.max_input_chars)
            assert isinstance(ids, list)  # EmbedRequest has no text input
            rid = request.request_id or f"embd-{uuid.uuid4().hex}"
            processed = ip.process_pooling(rid, ids, PoolingParams())
            out = await state.llm.encode(processed, timeout=state.config.frontend.request_timeout)
        except Exception as exc:
            await self._abort(context, exc, request.request_id)
            raise AssertionError("unreachable: context.abort raises") from exc
        vector = out.outputs.data.tolist()
        return pb.EmbedResponse(embedding=vector, prompt_tokens=len(out.prompt_token_ids), embedding_dim=len(vector))

    async def FlushCache(  # noqa: N802
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        """Empty every engine core's prefix cache (``/reset_prefix_cache``: also only with
        ``frontend.server_dev_mode``, else UNIMPLEMENTED). A core whose cache running requests
        hold is asked again until ``timeout_s`` passes (0: once)."""
        state = self.state
        if not state.config.frontend.server_dev_mode:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "FlushCache needs frontend.server_dev_mode: true")
        deadline = time.monotonic() + max(0.0, request.timeout_s)
        while True:
            try:
                state.check_ready()
                results = await state.llm.client.call_utility("reset_prefix_cache", None)
            except Exception as exc:
                await self._abort(context, exc, "flush-cache")
            refused = next((r.error for r in results if r.error is not None), None)
            if refused is not None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refused)
            if all(r.result for r in results):
                return common_pb2.FlushCacheResponse(success=True, message="prefix cache flushed")
            if time.monotonic() >= deadline:
                return common_pb2.FlushCacheResponse(
                    success=False, message="running requests hold the prefix cache; retry when the engine is idle"
                )
            await asyncio.sleep(0.1)

    async def _abort(self, context: grpc.aio.ServicerContext, exc: BaseException, rid: str) -> None:
        if isinstance(exc, grpc.aio.AbortError):
            raise exc
        code, message = status_of(exc)
        if code is grpc.StatusCode.INTERNAL:
            logger.error("grpc_request_failed", request_id=rid, error=message, exc_info=exc)
        await context.abort(code, message)

    # ---- state -----------------------------------------------------------------------------

    async def HealthCheck(  # noqa: N802
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        status, body = self.state.health()
        return pb.HealthCheckResponse(healthy=status == 200, message=body["status"])

    async def GetModelInfo(  # noqa: N802
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        state = self.state
        if not state.llm.is_ready() and state.llm.handshake is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no engine core is available yet; retry shortly")
        hs = state.llm.handshake
        assert hs is not None
        tok = state.llm.tokenizer
        model_cfg = await asyncio.to_thread(_model_config, state)
        eos = _eos_ids(hs.eos_token_id, model_cfg, state.llm.generation_defaults)
        defaults = {k: v for k, v in state.llm.generation_defaults.items() if v is not None}
        defaults.update({k: v for k, v in state.config.model.generation.model_dump().items() if v is not None})
        return pb.GetModelInfoResponse(
            model_path=state.config.model.source,
            is_generation=hs.runner == "generate",
            max_context_length=hs.max_model_len,
            vocab_size=hs.vocab_size,
            supports_vision=False,
            served_model_name=state.served_model_names()[0],
            tokenizer_path=state.config.model.tokenizer or state.config.model.source,
            model_type=str(model_cfg.get("model_type", "")),
            architectures=[str(a) for a in model_cfg.get("architectures", [])],
            eos_token_ids=eos,
            pad_token_id=_token_id(tok, "pad_token_id"),
            bos_token_id=_token_id(tok, "bos_token_id"),
            max_req_input_len=max(0, hs.max_model_len - 1),
            default_sampling_params_json=json.dumps(defaults),
        )

    async def GetServerInfo(  # noqa: N802
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        cfg = self.state.config
        hs = self.state.llm.handshake
        return pb.GetServerInfoResponse(
            active_requests=self.state.llm.num_inflight(),
            is_paused=self.state.draining,
            last_receive_timestamp=self.last_receive,
            uptime_seconds=time.time() - self.started,
            server_type="vllm-grpc",
            data_parallel_size=cfg.serve_plan().dp_size,
            kv_cache_dtype=cfg.cache.cache_dtype,
            block_size=hs.block_size if hs is not None else 0,
            model_dtype=cfg.model.dtype,
            max_num_seqs=cfg.scheduler.max_num_seqs,
            constrained_decoding_start="first_token",  # the engine has no reasoning-gated grammar
        )

    async def GetLoads(self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext) -> pb.GetLoadsResponse:  # noqa: N802
        want = request.dp_rank if request.HasField("dp_rank") else None
        loads = []
        max_seqs = self.state.config.scheduler.max_num_seqs
        for index, (hs, stats) in sorted(self.state.llm.client.engine_info().items()):
            if want is not None and index != want:
                continue
            capacity = hs.num_kv_blocks * hs.block_size if hs is not None else 0
            loads.append(
                pb.SchedulerLoad(
                    dp_rank=index,
                    num_running_reqs=stats.num_running_reqs,
                    num_waiting_reqs=stats.num_waiting_reqs,
                    num_total_reqs=stats.num_running_reqs + stats.num_waiting_reqs,
                    num_used_tokens=round(stats.kv_cache_usage * capacity),
                    max_total_num_tokens=capacity,
                    token_usage=stats.kv_cache_usage,
                    cache_hit_rate=stats.prefix_cache_hits / stats.prefix_cache_queries
                    if stats.prefix_cache_queries
                    else 0.0,
                    utilization=stats.num_running_reqs / max_seqs,
                    max_running_requests=max_seqs,
                )
            )
        if want is not None and not loads:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"dp_rank {want} is not served here")
        return pb.GetLoadsResponse(
            timestamp=datetime.datetime.now(datetime.UTC).isoformat(),
            version=__version__,
            dp_rank_count=len(loads),
            loads=loads,
        )

    async def GetTokenizer(  # noqa: N802
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        if self.state.llm.tokenizer is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the tokenizer is not loaded yet; retry shortly")
        if self._tokenizer_zip is None or (self._tokenizer_zip.done() and self._tokenizer_zip.exception()):
            self._tokenizer_zip = asyncio.ensure_future(asyncio.to_thread(tokenizer_archive, self.state))
        try:
            data, digest = await asyncio.shield(self._tokenizer_zip)
        except Exception as exc:  # OSError, ModelSourceError: the files are not (or no longer) there
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot read the tokenizer files: {exc}")
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            end = start + TOKENIZER_CHUNK_BYTES
            yield common_pb2.GetTokenizerChunk(data=data[start:end], sha256=digest if end >= len(data) else "")


def _input_processor(state: ServerState) -> InputProcessor:
    ip = state.llm.input_processor
    if ip is None:
        raise EngineUnavailableError("no engine core is available (starting or restarting); retry shortly")
    return ip


def _emptied(completion: Any) -> Any:
    """``completion`` without tokens: a stream's chunks carried them already."""
    return dataclasses.replace(completion, token_ids=[], logprobs=None)


def _aborted(processed: ProcessedRequest) -> pb.GenerateResponse:
    """The final message of a request aborted before any output."""
    return pb.GenerateResponse(
        complete=pb.GenerateComplete(finish_reason="abort", prompt_tokens=len(processed.prompt_token_ids))
    )


def _token_id(tokenizer: Any, name: str) -> int:
    value = getattr(tokenizer, name, None)
    return value if isinstance(value, int) else 0


def _model_config(state: ServerState) -> dict[str, Any]:
    """The served model's ``config.json`` (empty when it cannot be read)."""
    try:
        from pkgd.model_files.resolve import resolve_model

        path = resolve_model(state.config.model, convert=False).model_dir / "config.json"
        data = json.loads(path.read_text())
    except Exception:  # OSError, ValueError, ModelSourceError: GetModelInfo answers without it
        return {}
    return data if isinstance(data, dict) else {}


def _eos_ids(engine_eos: int | None, model_cfg: dict[str, Any], defaults: dict[str, Any]) -> list[int]:
    ids: list[int] = [] if engine_eos is None else [engine_eos]
    for extra in (model_cfg.get("eos_token_id"), defaults.get("eos_token_id")):
        for tid in extra if isinstance(extra, list) else [extra]:
            if isinstance(tid, int) and tid not in ids:
                ids.append(tid)
    return ids


def tokenizer_archive(state: ServerState) -> tuple[bytes, str]:
    """The served tokenizer's files as a zip archive and its SHA-256 (hex): the files of the
    resolved tokenizer directory (`TOKENIZER_FILES`, ``*.jinja``), plus the chat template
    pkgd renders with (``model.chat_template`` or the tokenizer's) as ``chat_template.jinja``,
    so a router renders chats as the HTTP API does.

    Raises OSError when the directory cannot be read, `ModelSourceError` / `NotConverted`
    when the model no longer resolves to it.
    """
    from pkgd.model_files.resolve import resolve_model

    directory = Path(resolve_model(state.config.model, convert=False).tokenizer_dir)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        names = [n for n in TOKENIZER_FILES if (directory / n).is_file()]
        names += sorted(p.name for p in directory.glob("*.jinja") if p.name != "chat_template.jinja")
        for name in names:
            zf.write(directory / name, name)
        template = getattr(state.llm.tokenizer, "chat_template", None)
        if isinstance(template, str):
            zf.writestr("chat_template.jinja", template)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()

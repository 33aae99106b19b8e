"""``POST /v1/completions``: text or token-id prompts (one or a batch), ``n``, ``echo``,
``logprobs``, ``stop``, ``seed``, structured outputs (``structured_outputs``, ``guided_*``),
streaming with ``stream_options.include_usage`` (and ``continuous_usage_stats``).

Choice ``index`` is ``prompt_index * n + completion_index``, as OpenAI numbers a batch.

``echo`` with ``max_tokens: 0`` scores the prompt (what evaluation harnesses send for
log-likelihoods): the engine computes the prompt's logprobs while generating one token, which
is dropped; the choice is the prompt with its logprobs, ``completion_tokens`` 0 and
``finish_reason`` "length", as vLLM answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pkgd.api import serving
from pkgd.api.errors import APIError
from pkgd.api.preprocess import parse_body, worker_input_processor
from pkgd.api.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
    PromptLogprobsList,
)
from pkgd.frontend.input_processor import TokenizedPrompt
from pkgd.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pkgd.api.state import ServerState
    from pkgd.config.sections import FrontendLimits
    from pkgd.frontend.input_processor import ProcessedRequest
    from pkgd.outputs import CompletionOutput, Logprob, RequestOutput


async def create_completion(
    request: Request,
    state: ServerState,
    parsed: CompletionRequest | None = None,
    tokenized: list[TokenizedPrompt | None] | None = None,
) -> Any:
    """Answer one completion request (a prompt or a batch); parsing, the constraint check and
    tokenization run on the `Preprocessor`, never on the event loop (a large body is parsed
    and tokenized in its worker process). ``parsed``: the body, already parsed there
    (``/invocations``); ``tokenized``: what `tokenize_in_worker` made of it."""
    state.check_ready()
    raw = await request.body() if parsed is None else b""
    if parsed is None and state.preprocess.isolates(raw):
        parsed, tokenized = await state.preprocess.run_isolated(
            _parse_and_tokenize, raw, state.config.frontend.limits, serving.max_model_len(state)
        )
    fmt = await state.preprocess.run(_prepare, state, raw, request, parsed, tokenized)
    if fmt.body.stream:
        return StreamingResponse(
            serving.sse_events(fmt.stream()), media_type="text/event-stream", headers=serving.SSE_HEADERS
        )

    async def run_all() -> list[RequestOutput]:
        return list(await asyncio.gather(*(serving.final_output(state, p) for p in fmt.processed)))

    try:
        outputs = await serving.run_until_disconnected(request, run_all())
    except serving.ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    return await state.preprocess.run(lambda: JSONResponse(fmt.response(outputs).model_dump(exclude_none=False)))


def _prepare(
    state: ServerState,
    raw: bytes,
    request: Request,
    parsed: CompletionRequest | None,
    tokenized: list[TokenizedPrompt | None] | None = None,
) -> _Formatter:
    """Parse, check and tokenize a completion request (on the `Preprocessor`). ``tokenized``:
    per prompt of ``parsed``, what `_parse_and_tokenize` made of a text prompt (None for a
    token-id prompt, or for all of them to tokenize here)."""
    limits = state.config.frontend.limits
    body = parsed if parsed is not None else parse_body(raw, CompletionRequest, limits, serving.max_model_len(state))
    rid = serving.request_id("cmpl", request, body.request_id)
    model = state.resolve_model(body.model)
    serving.require_runner(state, "generate", "Completions API")
    score_only = body.max_tokens == 0  # echo: the prompt's logprobs, nothing generated
    params = serving.sampling_params(
        body, state, max_tokens=1 if score_only else body.max_tokens, logprobs=body.logprobs, stream=body.stream
    )
    if body.echo and body.logprobs is not None and params.prompt_logprobs is None:
        params = _with_prompt_logprobs(params, body.logprobs)
    params, _constraint = serving.with_constraint(state, body, params)
    prompts: list[Any] = list(body.prompts())
    if tokenized is not None:
        prompts = [p if t is None else t for p, t in zip(prompts, tokenized, strict=True)]
    processed = []
    for i, p in enumerate(prompts):
        try:
            # process() calls the lambda at once, so it sees this iteration's i and p
            processed.append(
                serving.process(
                    state,
                    lambda ip: ip.process(
                        f"{rid}-{i}" if len(prompts) > 1 else rid,
                        p,
                        params,
                        add_special_tokens=body.add_special_tokens,
                        priority=body.priority,
                        truncate_prompt_tokens=body.truncate_prompt_tokens,
                        prediction=body.prediction.text() if body.prediction is not None else None,
                    ),
                    model=model,
                )
            )
        except APIError as exc:
            if len(prompts) == 1:
                raise
            raise APIError(exc.status, f"prompt[{i}]: {exc.message}", param="prompt") from None
    for p in processed:
        serving.check_request_id_free(state, p.request_id)
    return _Formatter(state, body, rid, model, processed, score_only=score_only)


def _parse_and_tokenize(
    raw: bytes, limits: FrontendLimits, max_model_len: int | None
) -> tuple[CompletionRequest, list[TokenizedPrompt | None] | None]:
    """In the `Preprocessor`'s worker process: the parsed body and `tokenize_in_worker`'s
    prompts of it. Raises what `parse_body` raises."""
    body = parse_body(raw, CompletionRequest, limits, max_model_len)
    return body, tokenize_in_worker(body, max_model_len)


def tokenize_in_worker(body: CompletionRequest, max_model_len: int | None) -> list[TokenizedPrompt | None] | None:
    """In the `Preprocessor`'s worker process: each text prompt of ``body`` tokenized as
    `_prepare` would (ids left out of one that cannot fit ``max_model_len``), None for a
    token-id prompt; None for all without a tokenizer (the thread tokenizes)."""
    ip = worker_input_processor(max_model_len)
    if ip is None:
        return None
    add, keep = body.add_special_tokens, body.truncate_prompt_tokens
    try:
        return [
            ip.tokenize_prompt(p, add_special_tokens=add, truncate_prompt_tokens=keep) if isinstance(p, str) else None
            for p in body.prompts()
        ]
    except ValueError:  # a bad truncate_prompt_tokens: the thread tokenizes and says so
        return None


def _with_prompt_logprobs(params: SamplingParams, k: int) -> SamplingParams:
    return msgspec.structs.replace(params, prompt_logprobs=k)


class _Formatter:
    """Builds the OpenAI objects for one completion request."""

    def __init__(
        self,
        state: ServerState,
        body: CompletionRequest,
        rid: str,
        model: str,
        processed: list[ProcessedRequest],
        *,
        score_only: bool = False,
    ) -> None:
        self.state, self.body, self.rid, self.model, self.processed = state, body, rid, model, processed
        self.score_only = score_only
        self.created = int(time.time())
        self.tokenizer = state.llm.tokenizer

    def _prompt_text(self, p: ProcessedRequest) -> str:
        if p.prompt is not None:
            return p.prompt
        return self.tokenizer.decode(p.prompt_token_ids) if self.tokenizer is not None else ""

    def response(self, outputs: list[RequestOutput]) -> CompletionResponse:
        n = self.body.n
        choices: list[CompletionChoice] = []
        completion_tokens = 0
        for i, (p, ro) in enumerate(zip(self.processed, outputs, strict=True)):
            prefix = self._prompt_text(p) if self.body.echo else ""
            for c in sorted(ro.outputs, key=lambda c: c.index):
                c = self._scored(c)
                completion_tokens += len(c.token_ids)
                logprobs = None
                if self.body.logprobs is not None:
                    logprobs = self._logprobs(c.logprobs or [], 0, ro if self.body.echo else None)
                choices.append(
                    CompletionChoice(
                        index=i * n + c.index,
                        text=prefix + c.text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=prompt_logprobs_json(ro) if self.body.prompt_logprobs is not None else None,
                    )
                )
        prompt_tokens = sum(len(p.prompt_token_ids) for p in self.processed)
        return CompletionResponse(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=serving.usage(
                prompt_tokens,
                completion_tokens,
                serving.prediction_counts(self.body, [c for ro in outputs for c in ro.outputs]),
            ),
        )

    def _scored(self, c: CompletionOutput) -> CompletionOutput:
        """With ``max_tokens: 0`` the one generated token is dropped (only the prompt counts)."""
        if not self.score_only:
            return c
        return dataclasses.replace(
            c,
            text="",
            token_ids=[],
            logprobs=[] if c.logprobs is not None else None,
            finish_reason="length" if c.finish_reason else None,
            stop_reason=None,
        )

    def _logprobs(
        self, sample: list[dict[int, Logprob]], offset: int, echo_of: RequestOutput | None
    ) -> CompletionLogprobs:
        out = CompletionLogprobs()
        entries: list[tuple[int, dict[int, Logprob] | None]] = []
        if echo_of is not None:
            prompt_lps = echo_of.prompt_logprobs or [None] * len(echo_of.prompt_token_ids)
            entries += list(zip(echo_of.prompt_token_ids, prompt_lps, strict=False))
        entries += [(next(iter(d)), d) for d in sample]
        for token_id, d in entries:
            token = self._token_str(token_id, d)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if d is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_finite(d[token_id].logprob))
            out.top_logprobs.append({self._token_str(t, d): _finite(lp.logprob) for t, lp in d.items()})
        return out

    def _token_str(self, token_id: int, d: dict[int, Logprob] | None) -> str:
        if d is not None and token_id in d and d[token_id].decoded_token is not None:
            return d[token_id].decoded_token  # type: ignore[return-value]
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    async def stream(self) -> AsyncIterator[str]:
        """JSON chunks of a streaming completion (then a usage chunk when asked)."""
        body, n = self.body, self.body.n
        gens = [self.state.llm.generate(p, timeout=self.state.config.frontend.request_timeout) for p in self.processed]
        started: set[int] = set()
        offsets: dict[int, int] = {}
        completion_tokens = 0
        prompt_tokens = sum(len(p.prompt_token_ids) for p in self.processed)
        continuous = serving.continuous_usage(body)
        latest: dict[int, Any] = {}  # choice index -> its newest output (prediction counts)
        # Closed on any exit (a bug below, the client leaving): that aborts the engine requests.
        async with contextlib.aclosing(serving.merge_streams(gens)) as merged:
            async for i, ro in merged:
                choices = []
                for c in ro.outputs:
                    c = self._scored(c)
                    index = i * n + c.index
                    latest[index] = c
                    completion_tokens += len(c.token_ids)
                    prefix = ""
                    if body.echo and index not in started:
                        prefix = self._prompt_text(self.processed[i])
                    started.add(index)
                    choices.append(self._stream_choice(index, prefix, c, ro, offsets))
                if choices:
                    usage = serving.usage(prompt_tokens, completion_tokens) if continuous else None
                    yield CompletionResponse(
                        id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage
                    ).model_dump_json()
        if body.stream_options is not None and body.stream_options.include_usage:
            yield CompletionResponse(
                id=self.rid,
                created=self.created,
                model=self.model,
                choices=[],
                usage=serving.usage(prompt_tokens, completion_tokens, serving.prediction_counts(body, latest.values())),
            ).model_dump_json()

    def _stream_choice(
        self, index: int, prefix: str, c: CompletionOutput, ro: RequestOutput, offsets: dict[int, int]
    ) -> CompletionChoice:
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = self._logprobs(
                c.logprobs or [], offsets.get(index, 0), ro if prefix and self.body.echo else None
            )
            offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs.tokens)
        return CompletionChoice(
            index=index,
            text=prefix + c.text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )


def prompt_logprobs_json(ro: RequestOutput) -> PromptLogprobsList:
    """``ro``'s prompt logprobs as vLLM answers them: per prompt position (the first null) the
    prompt token and the top candidates, keyed by token id."""
    return [
        None
        if d is None
        else {
            str(t): PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
            for t, lp in d.items()
        }
        for d in ro.prompt_logprobs or [None] * len(ro.prompt_token_ids)
    ]


def _finite(logprob: float) -> float:
    """JSON has no -inf: a token masked out (structured outputs) reads -9999.0, as in vLLM."""
    return max(logprob, -9999.0)

"""`OutputProcessor`: per-step `EngineCoreOutput`s → `RequestOutput`s (frontend side, torch-free).

vLLM v1's ``OutputProcessor``: one `RequestState` per engine request keeps the tokens, the
incremental detokenizer, logprobs and timing; each engine step's outputs update them and
produce `RequestOutput`s in the request's ``output_kind``:

* ``CUMULATIVE``: all text and tokens so far, every step;
* ``DELTA``: only what is new since the last output (streaming); a step that adds no visible
  text still yields an output when it adds tokens or finishes;
* ``FINAL_ONLY``: one output when the request finishes.

Stop strings are found here (the engine knows only token ids): the text is cut, the
completion finishes with ``finish_reason="stop"`` and ``stop_reason`` = the string, and the
request id is returned in ``reqs_to_abort`` so the caller aborts it in the engine.
``n > 1`` requests are aggregated under the client's id by `ParentRequest`.

Logprobs' ``decoded_token``: each token is decoded on its own, and a token whose text ends in
U+FFFD (it holds only part of a UTF-8 character, e.g. a byte-fallback or byte-level BPE token)
is decoded again after the tokens before it (vLLM's correction): the token that completes a
character carries all of it and the tokens before it an empty string, so joining the sampled
tokens' ``decoded_token`` rebuilds the text.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

from pkgd.frontend.detokenizer import IncrementalDetokenizer
from pkgd.frontend.input_processor import ProcessedRequest
from pkgd.frontend.parallel_sampling import ParentRequest
from pkgd.ipc.messages import EngineCoreOutput, FinishReason
from pkgd.logprobs import TokenLogprobs
from pkgd.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from pkgd.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


REPLACEMENT_CHAR = "\ufffd"
MAX_UTF8_BYTES = 4  # a UTF-8 character spans at most 4 bytes, so at most 4 tokens


def complete_token_text(tokenizer: PreTrainedTokenizerFast, token_id: int, context: list[int]) -> str:
    """The text ``token_id`` adds after ``context`` when decoded alone it ends in U+FFFD: with
    the character it completes whole (decoded with the fewest preceding tokens that make it
    whole), or, when it completes none (it starts or continues one), its text without the
    partial character."""
    for n in range(1, min(MAX_UTF8_BYTES, len(context)) + 1):
        ctx = context[-n:]
        full = _decode(tokenizer, [*ctx, token_id])
        if full.endswith(REPLACEMENT_CHAR):
            continue
        before = _decode(tokenizer, ctx).rstrip(REPLACEMENT_CHAR)
        if full.startswith(before):
            return full[len(before) :]
    return _decode(tokenizer, [token_id]).rstrip(REPLACEMENT_CHAR)


def _decode(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> str:
    # transformers annotates str | list[str]; one list of ids decodes to one str
    return cast(str, tokenizer.decode(ids))


@dataclasses.dataclass
class OutputProcessorResult:
    """``request_outputs`` to hand to callers; ``reqs_to_abort``: engine request ids that hit
    a stop string and must be aborted in the engine."""

    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]


class RequestState:
    """The frontend's state of one engine request (one completion)."""

    def __init__(
        self,
        request_id: str,
        index: int,
        processed: ProcessedRequest,
        params: SamplingParams,
        tokenizer: PreTrainedTokenizerFast | None,
        parent: ParentRequest | None,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.parent = parent
        self.client_request_id = processed.request_id
        self.prompt = processed.prompt
        self.prompt_token_ids = processed.prompt_token_ids
        self.params = params
        self.output_kind = params.output_kind
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, params, processed.prompt_token_ids)
        self.token_ids: list[int] = []
        self._sent_tokens = 0
        self._sent_logprobs = 0
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = None
        self.num_cached_tokens = 0
        self.prediction_counts = (0, 0)  # accepted, rejected (OpenAI Predicted Outputs)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.metrics = {"arrival_time": processed.arrival_time}

    def update(self, out: EngineCoreOutput, now: float) -> bool:
        """Apply one engine output; returns True when a stop string ended the completion."""
        self.metrics.setdefault("first_token_time", now)
        self.metrics["last_token_time"] = now
        if out.num_cached_tokens:
            self.num_cached_tokens = out.num_cached_tokens
        if out.accepted_prediction_tokens or out.rejected_prediction_tokens:  # cumulative
            self.prediction_counts = (out.accepted_prediction_tokens, out.rejected_prediction_tokens)
        if out.new_prompt_logprobs is not None:
            prompt = self.prompt_token_ids
            self.prompt_logprobs = [
                None if e is None else self._logprob_dict(e, prompt[max(0, i - MAX_UTF8_BYTES) : i])
                for i, e in enumerate(out.new_prompt_logprobs)
            ]
            if self.prompt_logprobs:
                self.prompt_logprobs[0] = None
        start = len(self.token_ids)
        self.token_ids.extend(out.new_token_ids)
        if self.logprobs is not None and out.new_logprobs:
            context = self.prompt_token_ids[-MAX_UTF8_BYTES:] + self.token_ids
            offset = len(context) - len(self.token_ids) + start
            for j, entry in enumerate(out.new_logprobs):
                self.logprobs.append(
                    self._logprob_dict(entry, context[max(0, offset + j - MAX_UTF8_BYTES) : offset + j])
                )
                assert self.cumulative_logprob is not None  # tracked together with logprobs
                self.cumulative_logprob += entry.logprobs[0]
        engine_stop = out.finish_reason == FinishReason.STOP
        stop_str = self.detokenizer.update(out.new_token_ids, engine_stop)
        if stop_str is not None:
            self.finish_reason, self.stop_reason = "stop", stop_str
            return True
        if out.finish_reason is not None:
            self.finish_reason = str(out.finish_reason)
            self.stop_reason = out.stop_reason
        return False

    def _logprob_dict(self, entry: TokenLogprobs, context: list[int]) -> dict[int, Logprob]:
        """``context``: the tokens before this position (at most ``MAX_UTF8_BYTES``)."""
        ids, lps = entry.token_ids, entry.logprobs
        result = {ids[0]: Logprob(lps[0], entry.rank, self._decode_token(ids[0], context))}
        for rank, (tid, lp) in enumerate(zip(ids[1:], lps[1:], strict=True), start=1):
            if tid not in result:
                result[tid] = Logprob(lp, rank, self._decode_token(tid, context))
        return result

    def _decode_token(self, token_id: int, context: list[int]) -> str | None:
        if self.tokenizer is None or not self.params.detokenize:
            return None
        text = _decode(self.tokenizer, [token_id])
        if not text.endswith(REPLACEMENT_CHAR):
            return text
        return complete_token_text(self.tokenizer, token_id, context)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def make_completion(self) -> CompletionOutput | None:
        """This step's `CompletionOutput` in the request's output kind, or None for nothing to say."""
        finished = self.finished
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = self.output_kind == RequestOutputKind.DELTA
        text = self.detokenizer.get_next_output_text(finished, delta)
        if delta:
            token_ids = self.token_ids[self._sent_tokens :]
            logprobs = self.logprobs[self._sent_logprobs :] if self.logprobs is not None else None
            if not token_ids and not text and not finished:
                return None
            self._sent_tokens = len(self.token_ids)
            self._sent_logprobs = len(self.logprobs) if self.logprobs is not None else 0
        else:
            token_ids = list(self.token_ids)
            logprobs = list(self.logprobs) if self.logprobs is not None else None
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            accepted_prediction_tokens=self.prediction_counts[0],
            rejected_prediction_tokens=self.prediction_counts[1],
        )

    def make_request_output(self, completion: CompletionOutput) -> RequestOutput:
        return RequestOutput(
            request_id=self.client_request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            metrics=dict(self.metrics),
        )


class OutputProcessor:
    """Turns engine outputs into `RequestOutput`s for every live request.

    Args:
        tokenizer: fast tokenizer for text and decoded logprob tokens; None = token ids only.

    Usage (what ``AsyncLLM`` and `LLM` do)::

        processed = input_processor.process(request_id, prompt, params)
        output_processor.add_request(processed)
        for r in processed.engine_requests: engine.add_request(r)
        ...
        result = output_processor.process_outputs(engine_outputs)
        engine.abort_requests(result.reqs_to_abort)
        for ro in result.request_outputs: deliver(ro)   # ro.request_id is the client's id
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast | None) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def add_request(self, processed: ProcessedRequest) -> None:
        """Track a request's engine requests; raises `ValueError` if its id is live."""
        if processed.request_id in self.parents or any(
            r.request_id in self.request_states for r in processed.engine_requests
        ):
            raise ValueError(f"request id {processed.request_id!r} is already in use")
        parent = None
        if len(processed.engine_requests) > 1:
            assert processed.sampling_params is not None  # only sampling requests fan out (n > 1)
            parent = ParentRequest(
                processed.request_id, len(processed.engine_requests), processed.sampling_params.output_kind
            )
            self.parents[processed.request_id] = parent
        for index, req in enumerate(processed.engine_requests):
            assert req.sampling_params is not None  # pooling requests are not tracked here
            self.request_states[req.request_id] = RequestState(
                req.request_id, index, processed, req.sampling_params, self.tokenizer, parent
            )

    def process_outputs(
        self, outputs: Iterable[EngineCoreOutput], *, timestamp: float | None = None
    ) -> OutputProcessorResult:
        """Apply one step's outputs; outputs for unknown (aborted) ids are ignored."""
        now = time.time() if timestamp is None else timestamp
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue
            if state.update(out, now):
                reqs_to_abort.append(out.request_id)
            completion = state.make_completion()
            if state.finished:
                del self.request_states[out.request_id]
            if completion is None:
                continue
            if state.parent is None:
                request_outputs.append(state.make_request_output(completion))
                continue
            ro = state.parent.add_completion(state, completion)
            if state.parent.finished:
                self.parents.pop(state.parent.request_id, None)
            if ro is not None:
                request_outputs.append(ro)
        return OutputProcessorResult(request_outputs, reqs_to_abort)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forget requests (client ids or engine ids); returns the engine ids to abort."""
        engine_ids: list[str] = []
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            if parent is not None:
                ids = [s.request_id for s in self.request_states.values() if s.parent is parent]
            else:
                ids = [rid] if rid in self.request_states else []
            for eid in ids:
                del self.request_states[eid]
            engine_ids.extend(ids)
        return engine_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        """Live engine requests (``n`` per ``n > 1`` request)."""
        return len(self.request_states)

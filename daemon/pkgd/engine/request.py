"""`Request`: the engine core's state of one request (vLLM v1's ``vllm/v1/request.py``).

The scheduler speaks in tokens: a request knows all its tokens (prompt
then outputs) and how many of them have KV in the cache (``num_computed_tokens``). Each step
the scheduler hands out more computed tokens until they catch up with ``num_tokens``; the
runner then samples one token, which `append_output_token_ids` adds. Prefill, chunked prefill,
decode and recompute after preemption are all this one rule. Torch-free.
"""

from __future__ import annotations

import enum
import itertools
from typing import Any

from pkgd.ipc.messages import EngineCoreRequest, FinishReason
from pkgd.logprobs import TokenLogprobs
from pkgd.lora_request import LoRARequest
from pkgd.pooling_params import PoolingParams
from pkgd.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; every status after ``PREEMPTED`` is final."""

    WAITING = 0  # in the waiting queue, never scheduled
    RUNNING = 1  # holds KV blocks and is scheduled each step it fits the budget
    PREEMPTED = 2  # lost its blocks (recompute); back in the waiting queue
    FINISHED_STOPPED = 3  # EOS, stop token id (or a stop string seen by the frontend)
    FINISHED_LENGTH_CAPPED = 4  # max_tokens or max_model_len reached
    FINISHED_ABORTED = 5  # aborted by the client / frontend

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        """The wire `FinishReason` of a finished status, None while unfinished."""
        return _FINISH_REASONS.get(self)


_arrival_counter = itertools.count()

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """One request inside the engine core.

    Attributes:
        request_id: unique among the engine's live requests.
        prompt_token_ids: the prompt (never empty).
        sampling_params: how it is sampled and when it stops; None for a pooling request.
        pooling_params: set for a pooling request (prefill only: it finishes when its
            prompt is computed, with the pooled vector as its output).
        skip_prefix_cache: take no prefix-cache hits (pooling over every position, mean or
            cls, needs each position computed).
        eos_token_id: end-of-sequence token, None when the model has none.
        arrival_time: Unix time in seconds (FCFS order, priority tie-break).
        priority: lower runs first under ``scheduler.policy: priority``.
        max_tokens: output limit: the sampling ``max_tokens``, else ``max_model_len - prompt
            length``; 0 for a pooling request.
        num_computed_tokens: tokens whose KV is in the cache or scheduled to be written this
            step (the scheduler advances it when it schedules them).
        status: a `RequestStatus`. stop_reason: the stop token id that ended it.
        block_hashes: chained hashes of the full blocks of ``all_token_ids``, extended lazily
            by the `KVCacheManager` (prefix caching).
        num_cached_tokens: prompt tokens served from the prefix cache when first scheduled;
            -1 until then.
        num_preemptions: how often it lost its blocks.
        queued_ts, scheduled_ts: Unix times in seconds when the scheduler received it and
            first scheduled it (0.0 until then).
        prompt_logprobs: prompt-position logprobs gathered from the runner, sent with the
            first output.
        structured_output: the constraint's compiled grammar and matcher
            (`pkgd.engine.structured_output.StructuredOutputRequest`), None when unconstrained.
        prediction_token_ids: OpenAI Predicted Outputs' tokens, the source of its proposals.
        spec_token_ids: the tokens proposed for it in the step being run (speculative
            decoding, `pkgd.engine.spec_decode`).
        num_accepted_prediction_tokens, num_rejected_prediction_tokens: proposed prediction
            tokens that verification accepted / rejected.
        draft_num_computed: draft_model: tokens whose draft-model KV is valid.
        lora_request: the adapter it runs with, None for the base model.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None,
        *,
        max_model_len: int,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
        skip_prefix_cache: bool = False,
        prediction_token_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        if (sampling_params is None) == (pooling_params is None):
            raise ValueError(f"request {request_id!r}: give exactly one of sampling_params and pooling_params")
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.skip_prefix_cache = skip_prefix_cache
        self.lora_request = lora_request
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.arrival_seq = next(_arrival_counter)  # creation order, the final tie-break
        # EngineCore.validate_request has checked prompt + max_tokens against max_model_len.
        if sampling_params is None:
            self.max_tokens = 0
        else:
            wanted = sampling_params.max_tokens
            self.max_tokens = max_model_len - len(self.prompt_token_ids) if wanted is None else wanted
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.queued_ts = 0.0
        self.scheduled_ts = 0.0
        self.prompt_logprobs: list[TokenLogprobs | None] = []
        self.sent_first_output = False
        self.structured_output: Any = None
        self.prediction_token_ids = list(prediction_token_ids) if prediction_token_ids else None
        self.spec_token_ids: list[int] = []
        self.num_accepted_prediction_tokens = 0
        self.num_rejected_prediction_tokens = 0
        self.draft_num_computed = 0

    @classmethod
    def from_engine_core_request(
        cls, req: EngineCoreRequest, *, max_model_len: int, skip_prefix_cache: bool = False
    ) -> Request:
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            max_model_len=max_model_len,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time,
            priority=req.priority,
            pooling_params=req.pooling_params,
            skip_prefix_cache=skip_prefix_cache,
            prediction_token_ids=req.prediction_token_ids,
            lora_request=req.lora_request,
        )

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model (vLLM's counting)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params is not None and self.sampling_params.prompt_logprobs is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    def append_output_token_ids(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """After a token was appended: set a finished status and return True when it ends here.

        Order (vLLM's ``check_stop``, except that a stop token on the last allowed position
        reports ``stop`` rather than ``length``): ``min_tokens`` suppresses EOS and stop tokens
        (the sampler already masks them; this keeps the rule even if it did not), then EOS
        unless ``ignore_eos``, then ``stop_token_ids``, then ``max_tokens`` / ``max_model_len``.
        """
        sp = self.sampling_params
        assert sp is not None, "a pooling request never samples"
        if self.num_output_tokens >= sp.min_tokens:
            last = self.all_token_ids[-1]
            if not sp.ignore_eos and last == self.eos_token_id:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in sp.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

"""The seam between `Scheduler` and `ModelRunner` (vLLM v1's ``SchedulerOutput``).

The scheduler speaks in tokens: each step it hands out, per request, how many of its tokens
to compute next (``num_scheduled_tokens``); prefill, chunked prefill and decode are the same
thing seen from the runner. Requests the runner has not seen travel in full
(`NewRequestData`); requests it already holds travel as diffs (`CachedRequestData`: newly
appended block ids and the new computed-token count). The runner never holds `Request`
objects.
"""

from __future__ import annotations

import dataclasses

from pkgd.lora_request import LoRARequest
from pkgd.pooling_params import PoolingParams
from pkgd.sampling_params import SamplingParams


@dataclasses.dataclass
class NewRequestData:
    """A request scheduled for the first time, or again after preemption (recompute).

    ``prompt_token_ids`` are the prompt's; ``output_token_ids`` the tokens generated before a
    preemption (empty otherwise) -- the runner recomputes them as part of the prefill.
    ``block_ids`` is the whole block table; ``num_computed_tokens`` counts tokens whose KV is
    already in the cache (prefix-cache hits), so computation starts there. A pooling request
    has ``pooling_params`` instead of ``sampling_params``: the runner pools its hidden states
    instead of sampling. ``lora_request``: the adapter its tokens run with (None = base model).
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams | None
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None


@dataclasses.dataclass
class CachedRequestData:
    """Diffs for requests the runner already holds, as parallel lists.

    ``new_block_ids[i]`` are blocks appended to request i's block table this step;
    ``num_computed_tokens[i]`` is its computed-token count before this step. The runner
    appends the token it sampled last step itself, so no token ids travel here.
    """

    req_ids: list[str] = dataclasses.field(default_factory=list)
    new_block_ids: list[list[int]] = dataclasses.field(default_factory=list)
    num_computed_tokens: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SchedulerOutput:
    """One step's work.

    ``num_scheduled_tokens[req_id]`` tokens of each scheduled request are computed this step,
    starting at its ``num_computed_tokens``; ``total_num_scheduled_tokens`` is their sum
    (at most ``scheduler.max_num_batched_tokens``). ``finished_req_ids`` (finished, aborted
    or preempted since the last step) tell the runner to drop its state for them.

    Structured outputs: ``grammar_bitmask`` is int32 ``[len(structured_output_request_ids),
    ceil(vocab_size / 32)]`` as little-endian bytes (bit ``t % 32`` of word ``t // 32`` set =
    token ``t`` allowed); ``structured_output_request_ids[req_id]`` is the request's row. The
    runner masks those requests' logits before sampling; other requests are not touched.

    Speculative decoding: ``scheduled_spec_decode_tokens[req_id]`` are the proposed tokens
    scheduled after the request's last known token (they count in its
    ``num_scheduled_tokens``); the runner verifies them and returns the accepted ones plus one
    sampled token. A speculating constrained request has ``1 + len(proposal)`` consecutive
    bitmask rows from its ``structured_output_request_ids`` row, one per verified position.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    structured_output_request_ids: dict[str, int] = dataclasses.field(default_factory=dict)
    grammar_bitmask: bytes | None = None
    scheduled_spec_decode_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class DraftSlot:
    """One request that may speculate this step: its tokens so far, its block table (draft
    model KV shares it), and the most tokens it may propose."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    max_tokens: int
    draft_num_computed: int = 0  # draft_model: tokens whose draft KV is valid

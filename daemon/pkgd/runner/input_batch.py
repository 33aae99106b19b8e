"""Per-request state the runner keeps, and the flattening of one step into a batch.

The scheduler sends new requests in full and known ones as diffs (`SchedulerOutput`); the
runner keeps each request's token ids (prompt + every token it sampled), block table,
sampling parameters and generator in a `RequestState`, and appends its own sampled tokens.

`build_batch` orders the scheduled requests with one-token queries first (decodes; see
`pkgd.runner.attention`) and produces the flattened inputs: ``input_ids``/``positions``
(int64 ``[T]``), ``slot_mapping`` (int64 ``[T]``), per-sequence block tables and lengths, the
rows whose logits are sampled, the rows whose logits give prompt logprobs, and the rows of
pooling requests (`pkgd.runner.pooler`), which sample nothing. A speculating request's
proposed tokens (``SchedulerOutput.scheduled_spec_decode_tokens``) follow its last known
token; its sample row is that token's, and ``drafts`` holds the proposal, whose rows follow
it. Attention sees such a request as ``1 + k`` one-token sequences at consecutive positions
over its block table (each attends up to its own position), so the step stays a decode step
(the CPU one-call decode serves it, `AttentionMetadata.shares_sequences`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pkgd.lora_request import LoRARequest
from pkgd.pooling_params import PoolingParams
from pkgd.runner.pooler import PoolingSpan
from pkgd.sampling_params import SamplingParams
from pkgd.scheduler_output import NewRequestData, SchedulerOutput


@dataclasses.dataclass
class RequestState:
    """What the runner knows about one request between steps."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    token_ids: list[int]  # prompt + outputs
    sampling_params: SamplingParams | None  # None for a pooling request
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    # Prompt logprobs are produced once: not again when a preempted request is recomputed.
    prompt_logprobs_pending: bool
    prompt_logprobs_started: bool = False
    pooling_params: PoolingParams | None = None
    pool_acc: torch.Tensor | None = None  # mean: float32 sum so far; cls: the first row
    lora_request: LoRARequest | None = None  # the adapter its tokens run with

    @classmethod
    def from_new(cls, new: NewRequestData) -> RequestState:
        p = new.sampling_params
        gen = None
        if p is not None and p.seed is not None and not p.greedy:
            gen = torch.Generator()
        return cls(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            output_token_ids=list(new.output_token_ids),
            token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
            sampling_params=p,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            generator=gen,
            prompt_logprobs_pending=p is not None and p.prompt_logprobs is not None and not new.output_token_ids,
            pooling_params=new.pooling_params,
            lora_request=new.lora_request,
        )

    def append(self, token: int) -> None:
        self.token_ids.append(token)
        self.output_token_ids.append(token)


@dataclasses.dataclass
class PromptLogprobsSpan:
    """Hidden rows ``[row_start, row_end)`` give the logprobs of prompt tokens
    ``target_ids``; ``leading_nones`` entries (the first prompt token and prefix-cache hits,
    which nothing computed here predicts) come first."""

    req_id: str
    row_start: int
    row_end: int
    target_ids: list[int]
    num_logprobs: int
    leading_nones: int


@dataclasses.dataclass
class StepBatch:
    """One step, flattened. Sequence i of ``states`` owns tokens
    ``[query_start_loc[i], query_start_loc[i+1])``."""

    states: list[RequestState]
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    block_table_rows: list[list[int]]
    sample_rows: list[int]  # token rows whose logits are sampled
    sample_states: list[RequestState]
    prompt_logprobs: list[PromptLogprobsSpan]
    pooling: list[PoolingSpan] = dataclasses.field(default_factory=list)  # rows of pooling requests
    drafts: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # speculative proposals
    state_tokens: list[int] = dataclasses.field(default_factory=list)  # tokens of each of ``states``
    # ``query_lens``/``seq_lens``/``block_table_rows`` are per attention sequence: one per
    # request, except 1 + len(proposal) for a speculating one.


def update_states(states: dict[str, RequestState], so: SchedulerOutput) -> None:
    """Apply a step's diffs: drop finished requests, add new ones, extend known ones."""
    for req_id in so.finished_req_ids:
        states.pop(req_id, None)
    for new in so.scheduled_new_reqs:
        states[new.req_id] = RequestState.from_new(new)
    cached = so.scheduled_cached_reqs
    for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
        st = states.get(req_id)
        if st is None:
            raise KeyError(f"scheduler sent a diff for request {req_id!r}, which the runner does not hold")
        st.block_ids.extend(new_blocks)
        st.num_computed_tokens = num_computed


def build_batch(states: dict[str, RequestState], so: SchedulerOutput, block_size: int) -> StepBatch:
    """Flatten the scheduled requests (one-token queries first).

    Raises:
        ValueError: a request is scheduled past its known tokens or its block table.
    """
    spec = so.scheduled_spec_decode_tokens
    order = sorted(so.num_scheduled_tokens.items(), key=lambda kv: kv[1] != 1 and kv[0] not in spec)
    ids: list[int] = []
    pos_parts: list[np.ndarray] = []
    slot_parts: list[np.ndarray] = []
    batch = StepBatch([], torch.empty(0), torch.empty(0), torch.empty(0), [], [], [], [], [], [])
    for req_id, n in order:
        st = states[req_id]
        start = st.num_computed_tokens
        end = start + n
        draft = so.scheduled_spec_decode_tokens.get(req_id, [])
        known_end = end - len(draft)
        if known_end > len(st.token_ids) or (draft and known_end != len(st.token_ids)):
            raise ValueError(
                f"request {req_id!r}: {n} tokens scheduled from {start}, but only {len(st.token_ids)} are known"
            )
        if -(-end // block_size) > len(st.block_ids):
            raise ValueError(
                f"request {req_id!r}: {end} tokens need {-(-end // block_size)} blocks, table has {len(st.block_ids)}"
            )
        offset = len(ids)
        ids.extend(st.token_ids[start:known_end])
        ids.extend(draft)
        pos = np.arange(start, end, dtype=np.int64)
        pos_parts.append(pos)
        slot_parts.append(np.asarray(st.block_ids, dtype=np.int64)[pos // block_size] * block_size + pos % block_size)
        batch.states.append(st)
        batch.state_tokens.append(n)
        if draft:  # verified positions: one-token sequences, position start + j attends 0..start + j
            batch.query_lens.extend([1] * n)
            batch.seq_lens.extend(range(start + 1, end + 1))
            batch.block_table_rows.extend([st.block_ids] * n)
        else:
            batch.query_lens.append(n)
            batch.seq_lens.append(end)
            batch.block_table_rows.append(st.block_ids)
        if st.pooling_params is not None:
            batch.pooling.append(PoolingSpan(st, offset, offset + n, start, end == len(st.token_ids)))
        elif known_end == len(st.token_ids):
            batch.sample_rows.append(offset + n - 1 - len(draft))
            batch.sample_states.append(st)
            if draft:
                batch.drafts[req_id] = list(draft)
        if st.prompt_logprobs_pending:
            _add_prompt_logprobs(batch, st, start, end, offset)
    batch.input_ids = torch.tensor(ids, dtype=torch.int64)
    batch.positions = torch.from_numpy(np.concatenate(pos_parts)) if pos_parts else torch.empty(0, dtype=torch.int64)
    batch.slot_mapping = (
        torch.from_numpy(np.concatenate(slot_parts)) if slot_parts else torch.empty(0, dtype=torch.int64)
    )
    return batch


def _add_prompt_logprobs(batch: StepBatch, st: RequestState, start: int, end: int, offset: int) -> None:
    assert st.sampling_params is not None  # prompt logprobs are a sampling request's
    num_prompt = len(st.prompt_token_ids)
    last = min(end, num_prompt - 1)  # position num_prompt - 1 predicts the first output
    targets = st.prompt_token_ids[start + 1 : last + 1] if last > start else []
    batch.prompt_logprobs.append(
        PromptLogprobsSpan(
            req_id=st.req_id,
            row_start=offset,
            row_end=offset + len(targets),
            target_ids=targets,
            num_logprobs=st.sampling_params.prompt_logprobs or 0,
            leading_nones=0 if st.prompt_logprobs_started else start + 1,
        )
    )
    st.prompt_logprobs_started = True
    if end >= num_prompt:
        st.prompt_logprobs_pending = False

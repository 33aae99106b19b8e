"""`Scheduler`: continuous batching with a token budget (vLLM v1's ``vllm/v1/core/sched/``).

Each `schedule` hands out token counts under ``scheduler.max_num_batched_tokens``: every
request's computed tokens catch up with its tokens, so a long prompt is spread over steps
(chunked prefill), a decode is one token, and a request resumed after preemption recomputes
its prompt and outputs, all in the same batch. Order of one step:

1. **Running requests first**, in order: each gets ``min(num_tokens - num_computed_tokens,
   budget left)`` tokens, and no more than ``scheduler.long_prefill_token_threshold`` when
   that is set (vLLM's cap on one request's prefill chunk). When the KV cache has no block
   for it, the lowest-priority running request (FCFS: the latest admitted; priority: the
   highest ``(priority, arrival)``) is *preempted by recompute*: its blocks are freed and it
   returns to the front of the waiting queue, keeping its output tokens.
2. **Waiting requests** (only when nothing was preempted this step), in queue order while
   budget, ``max_num_seqs`` and blocks allow: prefix-cache hits are taken first, then slots
   for the rest of the prompt (or a chunk of it). Unlike vLLM v1, a request is admitted only
   when the free blocks also cover the next ``admission_lookahead`` tokens of every running
   request and of itself (capped at each one's ``max_tokens``): admitting requests that the
   running ones will soon push out only to recompute them later wastes compute, which is
   the scarce resource on a CPU. When nothing runs, the head of the queue is always
   admitted if its prompt fits, and preemption still handles requests outgrowing the
   lookahead. ``admission_lookahead=0`` is vLLM's behaviour.

Full blocks are published to the prefix cache as soon as they are scheduled (vLLM v1 does
the same), so a request admitted later in the same step can already share them. That relies
on the runner's contract: in every layer the KV of all of a step's tokens is written to the
cache before any attention of that layer reads it.

`update_from_output` appends the runner's sampled tokens, applies the stop rules
(`Request.check_stop`; a constrained request also stops when its grammar is complete, after
its matcher accepted the token: `pkgd.engine.structured_output`),
frees finished requests at once (their blocks stay cached) and
returns one `EngineCoreOutput` per request that produced tokens. Speculative decoding
(`pkgd.engine.spec_decode`): a decoding request that speculates is scheduled for its last
token plus up to ``k`` proposed ones when the budget and the free blocks allow (else for one
token, as without speculation); the update rolls ``num_computed_tokens`` back over the
proposals the runner rejected. A pooling request is a
prefill that samples nothing: it is scheduled like any prompt (chunked, batched with the
others) and finishes on the step that computes its last prompt token, with the runner's
pooled vector as its one output; its blocks are freed in that same update. Torch-free.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable

from pkgd.config.sections import SchedulerConfig
from pkgd.engine.kv_cache_manager import KVCacheManager, cdiv
from pkgd.engine.request import Request, RequestStatus
from pkgd.engine.request_queue import create_request_queue
from pkgd.engine.spec_decode import Speculator
from pkgd.ipc.messages import ITERATION_TOKENS_BUCKETS, EngineCoreOutput, SchedulerStats
from pkgd.runner_output import ModelRunnerOutput
from pkgd.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

# Admission lookahead, in tokens (see the module docstring). Chosen by simulating 256 requests
# of 128 prompt tokens on SmolLM2's then-default CPU cache (728 blocks of 16, 512 MiB) with a null runner and
# the step cost measured for pkgd's runner on this 2-core machine (45 ms + 1.5 ms per token +
# 2.7 ms per token for the first 64 of a step: small decode batches are inefficient, so fewer,
# larger steps matter as much as fewer tokens). Without a lookahead 24-29 % of all computed
# tokens were recomputation after preemption; modelled output tokens/s for 128 output tokens,
# 16-256 output tokens (ignore_eos) and EOS after 16-256 of max_tokens 1024:
#   lookahead 0: 134 / 134 / 134;  16: 143 / 147 / 147;  32: 144 / 145 / 145;
#   64: 144 / 142 / 141;  128: 148 / 138 / 133 (no recomputation left, but smaller batches).
ADMISSION_LOOKAHEAD_TOKENS = 32


class Scheduler:
    """Decides, each step, which requests compute how many tokens.

    Args:
        scheduler_config: budget (``max_num_batched_tokens``, ``max_num_seqs``),
            ``enable_chunked_prefill`` and ``policy`` (``fcfs`` or ``priority``).
        kv_cache_manager: the block tables and prefix cache this scheduler fills.
        max_model_len: effective context length in tokens; requests stop there.
        admission_lookahead: tokens of growth reserved per request at admission (0 = none).
        speculator: speculative decoding (`pkgd.engine.spec_decode.Speculator`); None = a
            speculator that only serves requests with a prediction.
        max_loras: most distinct LoRA adapters among running requests (``lora.max_loras``;
            0 = LoRA off). A waiting request of another adapter waits while they are all in
            use; requests behind it may go first (vLLM's rule).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        *,
        max_model_len: int,
        admission_lookahead: int = ADMISSION_LOOKAHEAD_TOKENS,
        speculator: Speculator | None = None,
        max_loras: int = 0,
    ) -> None:
        self.max_loras = max_loras
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.policy = scheduler_config.policy
        self.max_model_len = max_model_len
        self.admission_lookahead = admission_lookahead
        self.kv_cache_manager = kv_cache_manager
        self.speculator = speculator or Speculator(None, None, (1, 1), max_model_len=max_model_len)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished, aborted or preempted since the last schedule(): the runner drops them.
        self.finished_req_ids: set[str] = set()
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        # tokens per step, vLLM's vllm:iteration_tokens_total (bucket counts, see SchedulerStats)
        self.iteration_tokens_counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.iteration_tokens_sum = 0

    # ---- requests in and out ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; raises `ValueError` for an id already live."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.queued_ts = time.time()
        self.waiting.add(request)

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[Request]:
        """End live requests now (abort): their blocks are freed at once. Unknown ids are
        ignored. Returns the requests ended."""
        ended = [self.requests[i] for i in set(request_ids) if i in self.requests]
        if not ended:
            return []
        gone = {id(r) for r in ended}
        self.running = [r for r in self.running if id(r) not in gone]
        self.waiting.remove(r for r in ended if r.status != RequestStatus.RUNNING)
        for request in ended:
            request.status = status
            self._free(request)
        return ended

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            iteration_tokens_counts=list(self.iteration_tokens_counts),
            iteration_tokens_sum=self.iteration_tokens_sum,
            spec_decode_num_drafts=self.speculator.stats.num_drafts,
            spec_decode_num_draft_tokens=self.speculator.stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.speculator.stats.num_accepted_tokens,
            spec_decode_accepted_per_pos=list(self.speculator.stats.accepted_per_pos),
            running_lora_adapters=sorted({r.lora_request.lora_name for r in self.running if r.lora_request}),
            waiting_lora_adapters=sorted({r.lora_request.lora_name for r in self.waiting if r.lora_request}),
        )

    # ---- one step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's work; advances ``num_computed_tokens`` of every scheduled request."""
        step = _Step(self.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step)
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                sampling_params=r.sampling_params,
                block_ids=self.kv_cache_manager.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                pooling_params=r.pooling_params,
                lora_request=r.lora_request,
            )
            for r in step.new
        ]
        cached = CachedRequestData()
        for r in step.running:
            cached.req_ids.append(r.request_id)
            cached.new_block_ids.append(step.new_block_ids[r.request_id])
            cached.num_computed_tokens.append(r.num_computed_tokens)
        for r in (*step.running, *step.new):
            r.num_computed_tokens += step.num_tokens[r.request_id]
        total = self.max_num_batched_tokens - step.budget
        if total:
            self.iteration_tokens_counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, total)] += 1
            self.iteration_tokens_sum += total
        finished, self.finished_req_ids = self.finished_req_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=step.num_tokens,
            total_num_scheduled_tokens=total,
            finished_req_ids=finished,
            scheduled_spec_decode_tokens={r.request_id: r.spec_token_ids for r in step.running if r.spec_token_ids},
        )

    def _schedule_running(self, step: _Step) -> None:
        i = 0
        while i < len(self.running) and step.budget > 0:
            request = self.running[i]
            num_new = min(self._chunk(request.num_tokens - request.num_computed_tokens), step.budget)
            if num_new <= 0:
                i += 1
                continue
            request.spec_token_ids = []
            k = self.speculator.num_to_propose(request, step.budget)
            if k and self.kv_cache_manager.can_allocate(request, 1 + k):
                num_new = 1 + k  # proposals are decided below, once every slot is allocated
                step.spec[request.request_id] = k
            while (block_ids := self.kv_cache_manager.allocate_slots(request, num_new)) is None:
                victim = self._pick_victim()
                if self.running.index(victim) < i:
                    i -= 1
                self._preempt(victim, step)
                if victim is request:
                    break
            if block_ids is None:
                continue  # ``request`` itself was preempted; index i now holds the next one
            step.add(request, num_new, block_ids, new=False)
            i += 1
        self._propose(step)
        # Published only now: a request preempted later in the loop must not leave hashes on
        # blocks whose KV this step will not compute. Proposed tokens are not published (the
        # cap at num_tokens): their KV may be rejected.
        for request in step.running:
            done = min(request.num_computed_tokens + step.num_tokens[request.request_id], request.num_tokens)
            self.kv_cache_manager.cache_blocks(request, done)

    def _propose(self, step: _Step) -> None:
        """Fill in the proposals of the requests scheduled to speculate; a shorter proposal
        gives its unused tokens back to the budget (slots stay allocated for the next step).
        A constrained request's proposal is cut where its grammar rejects a token."""
        reqs = [r for r in step.running if r.request_id in step.spec]
        if not reqs:
            return
        ks = [step.spec[r.request_id] for r in reqs]
        tables = [self.kv_cache_manager.get_block_ids(r.request_id) for r in reqs]
        for request, k, draft in zip(reqs, ks, self.speculator.propose(reqs, ks, tables)):
            so = request.structured_output
            if so is not None and draft:
                draft = draft[: so.num_acceptable(draft)]
            request.spec_token_ids = draft
            step.num_tokens[request.request_id] -= k - len(draft)
            step.budget += k - len(draft)

    def _chunk(self, num_new: int) -> int:
        """``num_new`` capped at ``long_prefill_token_threshold`` (0 = no cap), as vLLM v1 caps
        a step's tokens of one request; a decode's one token is never cut."""
        threshold = self.long_prefill_token_threshold
        return threshold if 0 < threshold < num_new else num_new

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time, r.arrival_seq))
        return self.running[-1]

    def _preempt(self, request: Request, step: _Step) -> None:
        self.running.remove(request)
        step.unschedule(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.draft_num_computed = 0  # its blocks, and the draft model's KV in them, are gone
        if not request.sent_first_output:
            request.prompt_logprobs = []  # recomputed from the start on resume
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_req_ids.add(request.request_id)
        self.waiting.prepend(request)
        step.preempted.append(request)

    def _lookahead_target(self, request: Request) -> int:
        return min(request.num_prompt_tokens + request.max_tokens, request.num_tokens + self.admission_lookahead)

    def _growth_blocks(self, request: Request) -> int:
        """Blocks a running request will still take within the admission lookahead."""
        held = len(self.kv_cache_manager.req_to_blocks.get(request.request_id, ()))
        return max(0, cdiv(self._lookahead_target(request), self.kv_cache_manager.block_size) - held)

    def _admission_fits(self, request: Request, hit_blocks: list, reserve: int) -> bool:
        """Whether the free blocks cover the running requests' growth (``reserve``) plus this
        request's prompt and growth, all within the lookahead. Always true when nothing runs."""
        if not self.admission_lookahead or not self.running:
            return True
        kv = self.kv_cache_manager
        need = cdiv(self._lookahead_target(request), kv.block_size) - len(hit_blocks)
        need += sum(1 for b in hit_blocks if b.ref_cnt == 0)  # free hits leave the free queue
        return kv.get_num_free_blocks() >= reserve + need

    def _schedule_waiting(self, step: _Step) -> None:
        skipped: list[Request] = []  # waiting for an adapter slot, put back in order
        try:
            self._admit_waiting(step, skipped)
        finally:
            for request in reversed(skipped):
                self.waiting.prepend(request)

    def _admit_waiting(self, step: _Step, skipped: list[Request]) -> None:
        kv = self.kv_cache_manager
        now = time.time()
        reserve = sum(self._growth_blocks(r) for r in self.running) if self.admission_lookahead else 0
        loras = {r.lora_int_id for r in self.running if r.lora_int_id}
        while len(self.waiting) and step.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if request.lora_int_id and request.lora_int_id not in loras and len(loras) >= self.max_loras:
                skipped.append(self.waiting.pop())  # every adapter slot is taken this step
                continue
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            # Without chunked prefill a prompt waits for a step with room for all of it,
            # unless it could never fit in one step (then it is chunked after all).
            if not self.enable_chunked_prefill and step.budget < num_new <= self.max_num_batched_tokens:
                break
            if not self._admission_fits(request, hit_blocks, reserve):
                break
            num_new = min(self._chunk(num_new), step.budget)
            block_ids = kv.allocate_slots(request, num_new, hit_blocks)
            if block_ids is None:
                break
            reserve += self._growth_blocks(request) if self.admission_lookahead else 0
            self.waiting.pop()
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            request.scheduled_ts = request.scheduled_ts or now
            self.running.append(request)
            if request.lora_int_id:
                loras.add(request.lora_int_id)
            kv.cache_blocks(request, num_hit + num_new)
            step.add(request, num_new, block_ids, new=True)

    # ---- after the runner ---------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's sampled tokens; returns outputs of requests that got tokens.

        Requests that stopped are freed before this returns (their blocks stay cached).
        Tokens for requests aborted since `schedule` are dropped.
        """
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        logprobs = runner_output.logprobs
        for i, req_id in enumerate(runner_output.req_ids):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            if request.is_pooling:
                pooled = runner_output.pooler_output.get(req_id)
                if pooled is not None:  # its whole prompt is computed: done, blocks freed now
                    request.status = RequestStatus.FINISHED_STOPPED
                    stopped.append(request)
                    outputs.append(self._make_output(request, [], None, pooling_output=pooled))
                continue
            prompt_lps = runner_output.prompt_logprobs.get(req_id)
            if prompt_lps and not request.sent_first_output:
                request.prompt_logprobs.extend(prompt_lps)
            sampled = runner_output.sampled_token_ids[i]
            draft = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if draft and sampled:
                num_accepted = len(sampled) - 1
                request.num_computed_tokens -= len(draft) - num_accepted  # rejected slots: rewritten
                request.draft_num_computed = min(request.draft_num_computed, request.num_tokens)
                request.spec_token_ids = []
                self.speculator.on_verified(request, len(draft), num_accepted)
            if not sampled or request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk that did not reach the end of the prompt
            new_ids: list[int] = []
            for token_id in sampled:
                request.append_output_token_ids(token_id)
                new_ids.append(token_id)
                if request.check_stop(self.max_model_len) or self._grammar_done(request, token_id):
                    stopped.append(request)
                    break
            outputs.append(self._make_output(request, new_ids, logprobs[i] if logprobs else None))
        if stopped:
            gone = {id(r) for r in stopped}
            self.running = [r for r in self.running if id(r) not in gone]
            for request in stopped:
                self._free(request)
        return outputs

    @staticmethod
    def _grammar_done(request: Request, token_id: int) -> bool:
        """Advance a constrained request's matcher by its new token; True (status set to
        stopped) when the grammar is complete, or when it rejected the token (only possible
        if no token was allowed, e.g. ``min_tokens`` banned the only stop token)."""
        so = request.structured_output
        if so is None:
            return False
        if so.accept(token_id) and not so.is_terminated():
            return False
        request.status = RequestStatus.FINISHED_STOPPED
        return True

    def _make_output(
        self, request: Request, new_ids: list[int], logprobs: list | None, *, pooling_output: bytes | None = None
    ) -> EngineCoreOutput:
        out = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            new_logprobs=logprobs[: len(new_ids)] if logprobs else None,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            pooling_output=pooling_output,
        )
        if out.finish_reason is not None:
            out.num_preemptions = request.num_preemptions
        # Cumulative on every output: a stop string may end the request in the frontend first.
        out.accepted_prediction_tokens = request.num_accepted_prediction_tokens
        out.rejected_prediction_tokens = request.num_rejected_prediction_tokens
        if not request.sent_first_output:
            request.sent_first_output = True
            out.num_cached_tokens = max(request.num_cached_tokens, 0)
            out.queued_ts, out.scheduled_ts = request.queued_ts, request.scheduled_ts
            if request.wants_prompt_logprobs:
                out.new_prompt_logprobs = request.prompt_logprobs
        return out


class _Step:
    """What one `Scheduler.schedule` call has decided so far."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.num_tokens: dict[str, int] = {}
        self.new_block_ids: dict[str, list[int]] = {}
        self.running: list[Request] = []
        self.new: list[Request] = []
        self.preempted: list[Request] = []
        self.spec: dict[str, int] = {}  # request id -> most tokens it may propose this step

    def add(self, request: Request, num_tokens: int, block_ids: list[int], *, new: bool) -> None:
        self.num_tokens[request.request_id] = num_tokens
        self.new_block_ids[request.request_id] = block_ids
        (self.new if new else self.running).append(request)
        self.budget -= num_tokens

    def unschedule(self, request: Request) -> None:
        """A request scheduled earlier in this step was preempted: give its tokens back."""
        num = self.num_tokens.pop(request.request_id, None)
        self.spec.pop(request.request_id, None)
        if num is not None:
            self.budget += num
            self.new_block_ids.pop(request.request_id)
            self.running.remove(request)

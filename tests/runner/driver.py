"""A minimal scheduler stand-in that drives a `ModelRunner` with hand-built `SchedulerOutput`s
(test helper): FCFS, a fixed per-request chunk size, blocks from a free list."""

from __future__ import annotations

import dataclasses

from pkgd.sampling_params import SamplingParams
from pkgd.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


@dataclasses.dataclass
class _Req:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    outputs: list[int] = dataclasses.field(default_factory=list)
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    sent: bool = False
    logprobs: list = dataclasses.field(default_factory=list)
    prompt_logprobs: list = dataclasses.field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.outputs) >= (self.params.max_tokens or 1)


class Driver:
    def __init__(self, runner, *, num_blocks: int = 64, block_size: int = 4) -> None:
        self.runner = runner
        self.block_size = block_size
        runner.initialize_kv_cache(num_blocks, block_size)
        self.free = list(range(num_blocks - 1, -1, -1))
        self.reqs: dict[str, _Req] = {}
        self.finished: set[str] = set()

    def add(self, req_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.reqs[req_id] = _Req(req_id, list(prompt), params)

    def step(self, chunk: int | None = None, only: set[str] | None = None):
        new, cached = [], CachedRequestData()
        sched: dict[str, int] = {}
        for r in self.reqs.values():
            if r.done or (only is not None and r.req_id not in only):
                continue
            known = len(r.prompt) + len(r.outputs)
            n = known - r.num_computed
            if chunk is not None:
                n = min(n, chunk)
            need = -(-(r.num_computed + n) // self.block_size) - len(r.blocks)
            fresh = [self.free.pop() for _ in range(max(0, need))]
            r.blocks += fresh
            sched[r.req_id] = n
            if not r.sent:
                new.append(
                    NewRequestData(r.req_id, r.prompt, list(r.outputs), r.params, list(r.blocks), r.num_computed)
                )
                r.sent = True
            else:
                cached.req_ids.append(r.req_id)
                cached.new_block_ids.append(fresh)
                cached.num_computed_tokens.append(r.num_computed)
        so = SchedulerOutput(new, cached, sched, sum(sched.values()), set(self.finished))
        self.finished.clear()
        out = self.runner.execute_model(so)
        for i, req_id in enumerate(out.req_ids):
            r = self.reqs[req_id]
            r.num_computed += sched[req_id]
            r.outputs += out.sampled_token_ids[i]
            if out.logprobs is not None and out.logprobs[i]:
                r.logprobs += out.logprobs[i]
            if req_id in out.prompt_logprobs:
                r.prompt_logprobs += out.prompt_logprobs[req_id]
            if r.done:
                self.finished.add(req_id)
                self.free += r.blocks
                r.blocks = []
        return out

    def preempt(self, req_id: str) -> None:
        """Recompute preemption: the runner drops the request; it comes back as new."""
        r = self.reqs[req_id]
        self.finished.add(req_id)
        self.free += r.blocks
        r.blocks, r.num_computed, r.sent = [], 0, False

    def flush(self) -> None:
        """An empty step that only tells the runner which requests finished."""
        self.runner.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, set(self.finished)))
        self.finished.clear()

    def run(self, chunk: int | None = None, max_steps: int = 10_000) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if all(r.done for r in self.reqs.values()):
                break
            self.step(chunk)
        return {k: r.outputs for k, r in self.reqs.items()}

"""The draft model of ``speculative.method: draft_model``: a second, smaller `ModelRunner` in
the engine-core process that proposes tokens greedily (`pkgd.engine.spec_decode`).

Its KV cache has the target's block count and block size and is addressed by the target's
block tables: a request's draft KV lives in the same block ids as its target KV, in the draft's
own cache, so the target's allocation (which covers ``1 + k`` tokens before proposals are
made) also covers the draft's ``k - 1`` proposal positions, and freeing or preempting a
request frees both. The engine tracks per request how many tokens have valid draft KV
(``Request.draft_num_computed``: reset to 0 when it loses its blocks); shared prefix-cache
blocks are simply rewritten by each request's draft with the same values.

Each engine step, for the requests that may speculate: one draft step computes the tokens the
draft has not seen (the prompt on the first round, then the tokens accepted since) and
samples the first proposal, then ``k - 1`` one-token draft steps sample the rest; all of it
greedy (temperature 0), so the proposal is deterministic and verification is exact (see
`pkgd.runner.rejection_sampler`). The draft runner's per-request state is rebuilt every round.
"""

from __future__ import annotations

from typing import Any

from pkgd.sampling_params import SamplingParams
from pkgd.scheduler_output import CachedRequestData, DraftSlot, NewRequestData, SchedulerOutput

_GREEDY = SamplingParams(temperature=0.0)


class DraftModelProposer:
    """Proposes tokens with ``runner`` (a loaded `pkgd.runner.model_runner.ModelRunner`)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    @classmethod
    def load(cls, config: Any, target_vocab_size: int, target_max_model_len: int) -> DraftModelProposer:
        """Load ``speculative.model`` with the target's dtype and device settings.

        Raises:
            ValueError: its vocabulary size differs from the target's, or its context is
                shorter than the target's ``max_model_len``.
        """
        from pkgd.model_files.resolve import resolve_model
        from pkgd.runner.model_runner import ModelRunner

        model = config.model.model_copy(
            update={"source": config.speculative.model, "name": None, "tokenizer": None, "max_model_len": None}
        )
        draft_config = config.model_copy(update={"model": model})
        runner = ModelRunner(draft_config, resolve_model(model))
        info = runner.model_info
        if info.vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative.model: {config.speculative.model} has a vocabulary of {info.vocab_size} tokens, "
                f"the target model {target_vocab_size}; a draft model needs the target's vocabulary"
            )
        if info.max_model_len < target_max_model_len:
            raise ValueError(
                f"speculative.model: {config.speculative.model} takes {info.max_model_len} tokens of context, "
                f"less than the target's max_model_len {target_max_model_len}; lower model.max_model_len"
            )
        return cls(runner)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return self.runner.kv_cache_bytes_per_block(block_size)

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.runner.initialize_kv_cache(num_blocks, block_size)

    def propose(self, slots: list[DraftSlot]) -> dict[str, list[int]]:
        """Up to ``slot.max_tokens`` greedy draft tokens per slot (see the module docstring)."""
        self.runner.states.clear()
        slots = [s for s in slots if s.max_tokens > 0 and s.draft_num_computed < len(s.token_ids)]
        if not slots:
            return {}
        first = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(s.request_id, s.token_ids, [], _GREEDY, s.block_ids, s.draft_num_computed) for s in slots
            ],
            scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens={s.request_id: len(s.token_ids) - s.draft_num_computed for s in slots},
            total_num_scheduled_tokens=sum(len(s.token_ids) - s.draft_num_computed for s in slots),
            finished_req_ids=set(),
        )
        drafts: dict[str, list[int]] = {s.request_id: [] for s in slots}
        self._collect(self.runner.execute_model(first), drafts)
        for j in range(1, max(s.max_tokens for s in slots)):
            live = [s for s in slots if s.max_tokens > j]
            cached = CachedRequestData(
                req_ids=[s.request_id for s in live],
                new_block_ids=[[] for _ in live],
                num_computed_tokens=[len(s.token_ids) + j - 1 for s in live],
            )
            step = SchedulerOutput(
                scheduled_new_reqs=[],
                scheduled_cached_reqs=cached,
                num_scheduled_tokens={s.request_id: 1 for s in live},
                total_num_scheduled_tokens=len(live),
                finished_req_ids=set(),
            )
            self._collect(self.runner.execute_model(step), drafts)
        self.runner.states.clear()
        return drafts

    @staticmethod
    def _collect(out: Any, drafts: dict[str, list[int]]) -> None:
        for req_id, tokens in zip(out.req_ids, out.sampled_token_ids):
            drafts[req_id].extend(tokens)

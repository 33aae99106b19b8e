"""A deterministic stand-in for ``pkgd.runner.model_runner.ModelRunner`` in engine tests.

Its "KV cache" stores, per slot, the token id written there; its "model" predicts the next
token from the tokens it reads back through the request's block table. A wrong block table,
slot, prefix-cache hit or diff therefore changes (or, checked, breaks) the output, which is
what the scheduler and KV-manager tests rely on. It follows the runner contract of
``pkgd/scheduler_output.py``: drop ``finished_req_ids`` first, take new requests in full,
apply cached-request diffs, compute ``num_scheduled_tokens`` tokens each, sample one token
when a request's computed tokens reach its length. A request with a grammar bitmask row gets
the first allowed token at or after its prediction (the mask is honoured, as the runner does).
"""

from __future__ import annotations

import dataclasses
import random
import types
from collections.abc import Callable

import numpy as np

from pkgd.logprobs import TokenLogprobs
from pkgd.runner_output import ModelRunnerOutput
from pkgd.sampling_params import SamplingParams
from pkgd.scheduler_output import SchedulerOutput


def hash_next_token(tokens: list[int], vocab_size: int) -> int:
    """Default "model": a mix of the last 8 tokens and the length."""
    acc = len(tokens)
    for t in tokens[-8:]:
        acc = (acc * 1000003 + t) & 0xFFFFFFFF
    return acc % vocab_size


@dataclasses.dataclass
class _State:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int
    params: SamplingParams
    num_prompt: int


class FakeModelRunner:
    def __init__(
        self,
        *,
        vocab_size: int = 1000,
        eos_token_id: int | None = None,
        max_model_len: int = 256,
        next_token: Callable[[list[int]], int] | None = None,
    ) -> None:
        self.model_info = types.SimpleNamespace(
            max_model_len=max_model_len, vocab_size=vocab_size, eos_token_id=eos_token_id, dtype="float32"
        )
        self.next_token = next_token or (lambda toks: hash_next_token(toks, vocab_size))
        self.reqs: dict[str, _State] = {}
        self.num_steps = 0
        self.batch_sizes: list[int] = []
        self.step_log: list[SchedulerOutput] = []

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return block_size * 64

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]

    def _slot(self, st: _State, pos: int) -> tuple[int, int]:
        block = st.block_ids[pos // self.block_size]
        assert 0 <= block < self.num_blocks, f"block id {block} out of range"
        return block, pos % self.block_size

    def _sample(self, st: _State) -> int:
        seen = [self.cache[b][o] for b, o in (self._slot(st, p) for p in range(len(st.tokens)))]
        assert seen == st.tokens, "KV cache content does not match the request's tokens"
        token = self.next_token(seen)
        if not st.params.greedy:  # "sampling": a draw keyed by (seed, position), so
            # a preempted request resumes with the same draws
            seed = st.params.seed if st.params.seed is not None else random.randrange(1 << 30)
            draw = random.Random(seed * 100003 + len(st.tokens)).randrange(self.model_info.vocab_size)
            token = (token + draw) % self.model_info.vocab_size
        eos = self.model_info.eos_token_id
        masked = set(st.params.stop_token_ids) | ({eos} if eos is not None else set())
        if token in masked and (len(st.tokens) - st.num_prompt < st.params.min_tokens):
            token = (token + 1) % self.model_info.vocab_size  # min_tokens masks EOS/stop ids
        if st.params.ignore_eos and token == eos:
            token = (token + 1) % self.model_info.vocab_size
        return token

    def _allowed(self, so: SchedulerOutput, rid: str, token: int) -> int:
        row = so.structured_output_request_ids.get(rid)
        if row is None:
            return token
        mask = np.frombuffer(so.grammar_bitmask, dtype=np.int32).reshape(len(so.structured_output_request_ids), -1)[row]
        allowed = np.flatnonzero((mask[:, None] >> np.arange(32)) & 1)
        allowed = allowed[allowed < self.model_info.vocab_size]
        assert allowed.size, f"{rid}: the grammar allows no token"
        later = allowed[allowed >= token]
        return int(later[0] if later.size else allowed[0])

    def _logprobs(self, tok: int, k: int | None) -> list[TokenLogprobs] | None:
        """The sampled token at -0.5, then k candidates tok, tok+1 … at -0.5, -1.2, -1.9 …"""
        if k is None:
            return None
        top = [(tok + j) % self.model_info.vocab_size for j in range(k)]
        return [TokenLogprobs([tok, *top], [-0.5, *(-0.5 - 0.7 * j for j in range(k))], 1)]

    def sleep(self, level: int) -> None:
        self.slept = getattr(self, "slept", []) + [level]
        self.cache = []

    def wake_up(self, tags: list[str]) -> None:
        self.woken = getattr(self, "woken", []) + [list(tags)]
        if "kv_cache" in tags:
            self.initialize_kv_cache(self.num_blocks, self.block_size)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        self.step_log.append(so)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} sent as new while held"
            self.reqs[new.req_id] = _State(
                new.prompt_token_ids + new.output_token_ids,
                list(new.block_ids),
                new.num_computed_tokens,
                new.sampling_params,
                len(new.prompt_token_ids),
            )
        c = so.scheduled_cached_reqs
        for rid, blocks, num_computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens, strict=True):
            st = self.reqs[rid]
            assert st.num_computed == num_computed, f"{rid}: computed {st.num_computed} != {num_computed}"
            st.block_ids.extend(blocks)
        # Like a real runner's layers: every scheduled token's KV is written, then read.
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            assert st.num_computed + n <= len(st.tokens), f"{rid}: scheduled past its tokens"
            for pos in range(st.num_computed, st.num_computed + n):
                b, o = self._slot(st, pos)
                self.cache[b][o] = st.tokens[pos]
            st.num_computed += n
        req_ids, sampled, logprobs = [], [], []
        for rid in so.num_scheduled_tokens:
            st = self.reqs[rid]
            req_ids.append(rid)
            if st.num_computed == len(st.tokens):
                tok = self._allowed(so, rid, self._sample(st))
                st.tokens.append(tok)
                sampled.append([tok])
                logprobs.append(self._logprobs(tok, st.params.logprobs))
            else:
                sampled.append([])
                logprobs.append(None)
        self.batch_sizes.append(len(req_ids))
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs)


def fake_factory(**kwargs):
    """A ``runner_factory`` for `EngineCore` building a `FakeModelRunner`."""

    def factory(config):
        kw = dict(kwargs)
        if config.model.max_model_len is not None:
            kw["max_model_len"] = config.model.max_model_len
        return types.SimpleNamespace(name="fake", model_dir=None), FakeModelRunner(**kw)

    return factory

"""Speculative decoding in the engine core: draft proposals and their bookkeeping.

A speculating request that is decoding (all its known tokens but the last computed) is
scheduled for ``1 + k`` tokens: its last token plus ``k`` proposed ones, whose KV slots
are allocated like any other token's. The runner computes logits at all ``1 + k`` positions
in one target forward, accepts a prefix of the proposal (greedy: while it matches the argmax;
sampled: rejection sampling, `pkgd.runner.rejection_sampler`) and samples one more token, so a
step yields ``1 .. k + 1`` tokens. `Scheduler.update_from_output` then rolls
``num_computed_tokens`` back over the rejected proposals, whose KV slots the next step
overwrites; prefix caching publishes only blocks of verified tokens.

Proposers (vLLM's names):

* **ngram** (prompt lookup decoding, Saxena 2023): the ``k`` tokens that followed an earlier
  occurrence of the longest suffix n-gram of prompt + output, ``n`` from ``prompt_lookup_max``
  down to ``prompt_lookup_min`` (`ngram_propose` says which occurrence);
* **prediction** (OpenAI Predicted Outputs): the same lookup against the request's predicted
  text, so the proposal follows the prediction from wherever the output has realigned with it;
  an output that has not started yet proposes the prediction's beginning;
* **draft_model**: a smaller model of the same vocabulary, run greedily for ``k`` steps
  (`pkgd.runner.draft_model`). A greedy draft is a deterministic proposal (q one-hot), so the
  same verification preserves the target distribution.

Torch-free (numpy only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pkgd.scheduler_output import DraftSlot

if TYPE_CHECKING:
    from pkgd.engine.request import Request

# A request with a prediction but no speculative config proposes this many tokens per step,
# and matches n-grams of these lengths against the prediction.
PREDICTION_NUM_TOKENS = 8
PREDICTION_LOOKUP = (1, 8)


def ngram_propose(tokens: Sequence[int] | np.ndarray, lookup_min: int, lookup_max: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the longest suffix n-gram of
    ``tokens`` (``lookup_max >= n >= lookup_min``): the latest one followed by ``k`` tokens,
    else the earliest; ``[]`` when no n-gram recurs."""
    arr = np.asarray(tokens, dtype=np.int64)
    length = arr.shape[0]
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        if n < 1:
            break
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)  # starts 0 .. length-1-n
        hits = np.flatnonzero((windows == arr[length - n :]).all(axis=1))
        hits = hits[hits < length - n]  # not the suffix itself
        if hits.size:
            # The latest occurrence followed by k known tokens, else the earliest (the longest
            # continuation: in a short loop the latest is followed by a token or two only).
            full = hits[hits + n + k <= length]
            start = int(full[-1] if full.size else hits[0]) + n
            return arr[start : start + k].tolist()
    return []


def prediction_propose(prediction: Sequence[int], output: Sequence[int], k: int) -> list[int]:
    """Up to ``k`` tokens of ``prediction`` continuing ``output``: its first ``k`` while the
    output is empty, else what follows the occurrence in the prediction of the longest suffix
    of the output (``PREDICTION_LOOKUP`` tokens) that ends nearest ``len(output)``."""
    if not output:
        return list(prediction[:k])
    pred = np.asarray(prediction, dtype=np.int64)
    out = np.asarray(output[-PREDICTION_LOOKUP[1] :], dtype=np.int64)
    for n in range(min(PREDICTION_LOOKUP[1], out.shape[0], pred.shape[0]), PREDICTION_LOOKUP[0] - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(pred, n)
        hits = np.flatnonzero((windows == out[out.shape[0] - n :]).all(axis=1))
        if hits.size:
            # The occurrence nearest the output's own position (an edit shifts the text a
            # little; a repeated phrase elsewhere is likelier far away).
            start = int(hits[np.argmin(np.abs(hits + n - len(output)))]) + n
            return pred[start : start + k].tolist()
    return []


class DraftModel(Protocol):
    """A model-based proposer (`pkgd.runner.draft_model.DraftModelProposer`)."""

    def propose(self, slots: list[DraftSlot]) -> dict[str, list[int]]: ...


@dataclasses.dataclass
class SpecDecodeStats:
    """Cumulative counters behind vLLM's ``vllm:spec_decode_*`` metrics: proposals (one per
    request-step that proposed at least one token), proposed tokens, accepted tokens, and
    ``accepted_per_pos[i]`` proposals whose token ``i`` (0-based) was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


class Speculator:
    """What the `Scheduler` asks about speculation: how many tokens a request may propose this
    step, the proposals themselves, and the acceptance counters.

    Args:
        method: ``ngram``, ``draft_model`` or None (only requests with a prediction speculate).
        num_speculative_tokens: ``k``, the most tokens proposed per step (None: method off).
        lookup: ``(prompt_lookup_min, prompt_lookup_max)`` for ngram.
        draft_model: the proposer of ``method: draft_model``.
        max_model_len: a proposal never reaches past it.
    """

    def __init__(
        self,
        method: str | None,
        num_speculative_tokens: int | None,
        lookup: tuple[int, int],
        *,
        draft_model: DraftModel | None = None,
        max_model_len: int,
    ) -> None:
        if method == "draft_model" and draft_model is None:
            raise ValueError("speculative.method: draft_model needs the draft model loaded")
        self.method = method
        self.k = num_speculative_tokens or 0
        self.lookup = lookup
        self.draft_model = draft_model
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()

    def num_to_propose(self, request: Request, budget: int) -> int:
        """The most tokens ``request`` may propose this step: 0 unless it is decoding (only its
        last token is uncomputed) and speculates (a method is on or it has a prediction);
        bounded by ``budget - 1`` and by what its ``max_tokens`` and ``max_model_len`` leave
        after the one token a step always samples."""
        if request.is_pooling or request.num_computed_tokens != request.num_tokens - 1:
            return 0
        k = PREDICTION_NUM_TOKENS if request.prediction_token_ids and not self.k else self.k
        if not k or (self.method is None and not request.prediction_token_ids):
            return 0
        left = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
        return max(0, min(k, left, budget - 1))

    def propose(self, requests: list[Request], ks: list[int], block_ids: list[list[int]]) -> list[list[int]]:
        """Proposals (at most ``ks[i]`` tokens, maybe none) for ``requests`` (`Request`s whose
        KV slots for ``1 + ks[i]`` tokens are allocated, ``block_ids[i]`` their tables)."""
        out: list[list[int]] = [[] for _ in requests]
        model_slots: list[tuple[int, DraftSlot]] = []
        for i, (request, k) in enumerate(zip(requests, ks)):
            if request.prediction_token_ids:
                out[i] = prediction_propose(request.prediction_token_ids, request.output_token_ids, k)
            elif self.method == "ngram":
                out[i] = ngram_propose(request.all_token_ids, self.lookup[0], self.lookup[1], k)
            elif self.method == "draft_model":
                slot = DraftSlot(request.request_id, request.all_token_ids, block_ids[i], k, request.draft_num_computed)
                model_slots.append((i, slot))
        if model_slots:
            assert self.draft_model is not None  # checked in __init__
            found = self.draft_model.propose([s for _, s in model_slots])
            for i, slot in model_slots:
                out[i] = found.get(slot.request_id, [])[: ks[i]]
                # The draft's KV is now valid for every known token (its proposals' own KV is
                # not trusted: update_from_output keeps the count at verified tokens).
                requests[i].draft_num_computed = len(slot.token_ids)
        return out

    def on_verified(self, request: Request, num_draft: int, num_accepted: int) -> None:
        """Count one verified proposal (metrics, the prediction's usage counts)."""
        self.stats.observe(num_draft, num_accepted)
        if request.prediction_token_ids:
            request.num_accepted_prediction_tokens += num_accepted
            request.num_rejected_prediction_tokens += num_draft - num_accepted

"""Verification of speculative proposals: which proposed tokens a step keeps, and the one
token it samples after them (`pkgd.engine.spec_decode` has the engine's side).

A speculating request has logits at ``1 + k`` positions: position ``j`` predicts the token
after its last known token and proposals ``0 .. j-1``. Each position's logits are processed
exactly as without speculation (`Sampler`: penalties and ``min_tokens`` see the proposals
before it as outputs; the grammar bitmask of that position was applied by the runner).

* **Greedy**: proposal ``j`` is kept while it equals position ``j``'s argmax; the first argmax
  that differs (or position ``k``'s, when all were kept) is the sampled token. The output is
  the output without speculation, token for token.
* **Sampled** (Leviathan et al., 2023, "Fast Inference from Transformers via Speculative
  Decoding"; Chen et al., 2023): with target distribution ``p`` and proposal distribution
  ``q``, proposal ``x`` is kept with probability ``min(1, p(x) / q(x))``, else the token is
  drawn from ``norm(max(p - q, 0))``. Every pkgd proposer is deterministic (n-gram lookup, a
  prediction, a greedy draft model), so ``q`` is one-hot at ``x``: keep ``x`` with probability
  ``p(x)``, else draw from ``p`` with ``x`` removed. Each emitted token is then distributed
  exactly as ``p``: ``P(x) = p(x)``, ``P(y) = (1 - p(x)) p(y) / (1 - p(x))``.

Draws use the request's generator re-seeded per output index (`pkgd.runner.sampler.step_seed`)
when it is seeded, else the runner's shared generator; the draw from ``p`` is the exponential
race the sampler uses (which needs no normalisation).
"""

from __future__ import annotations

import dataclasses

import torch

from pkgd.logprobs import TokenLogprobs
from pkgd.runner.sampler import Sampler, SamplingRow, batch_token_logprobs, step_seed


@dataclasses.dataclass
class VerifyGroup:
    """One request sampling this step: ``row`` its sampling state before the step,
    ``draft`` its proposed tokens (empty: an ordinary one-token sample); its logits rows are
    ``1 + len(draft)`` consecutive rows."""

    row: SamplingRow
    draft: list[int]


def expand_rows(groups: list[VerifyGroup]) -> list[SamplingRow]:
    """One `SamplingRow` per logits row: position ``j`` sees proposals ``0 .. j-1`` as outputs."""
    out: list[SamplingRow] = []
    for g in groups:
        r = g.row
        for j in range(len(g.draft) + 1):
            out.append(SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids + g.draft[:j], r.generator))
    return out


def verify(
    sampler: Sampler, logits: torch.Tensor, groups: list[VerifyGroup]
) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
    """Verify every group's proposal on ``logits [sum(1 + len(draft)), V]`` (float32, host,
    modified in place). Returns per group the emitted tokens (kept proposals, then one sampled
    token) and, for groups that asked for logprobs, one entry per emitted token."""
    rows = expand_rows(groups)
    want_lp = any(r.params.logprobs is not None for r in rows)
    raw_lp = torch.log_softmax(logits, dim=-1) if want_lp else None
    sampler._process(logits, rows)
    greedy = [r.params.greedy for r in rows]
    argmax = logits.argmax(dim=-1).tolist() if any(greedy) else []
    r_idx = [i for i, g in enumerate(greedy) if not g]
    probs = Sampler.probs(logits[r_idx], [rows[i] for i in r_idx]) if r_idx else None
    prob_row = {i: n for n, i in enumerate(r_idx)}
    emitted: list[list[int]] = []
    logprobs: list[list[TokenLogprobs] | None] = []
    start = 0
    for g in groups:
        if g.row.params.greedy:
            tokens = _verify_greedy(argmax[start : start + len(g.draft) + 1], g.draft)
        else:
            assert probs is not None
            tokens = _verify_sampled(sampler, probs, [prob_row[start + j] for j in range(len(g.draft) + 1)], g)
        emitted.append(tokens)
        if raw_lp is not None and g.row.params.logprobs is not None:
            lp_rows = raw_lp[start : start + len(tokens)]
            logprobs.append(batch_token_logprobs(lp_rows, torch.tensor(tokens), [g.row.params.logprobs] * len(tokens)))
        else:
            logprobs.append(None)
        start += len(g.draft) + 1
    return emitted, logprobs


def _verify_greedy(argmax: list[int], draft: list[int]) -> list[int]:
    out: list[int] = []
    for j, target in enumerate(argmax):
        out.append(target)
        if j >= len(draft) or draft[j] != target:
            break
    return out


def _verify_sampled(sampler: Sampler, probs: torch.Tensor, rows: list[int], g: VerifyGroup) -> list[int]:
    out: list[int] = []
    seed = g.row.params.seed
    for j, row in enumerate(rows):
        gen = sampler.generator
        if g.row.generator is not None:
            gen = g.row.generator
            gen.manual_seed(step_seed(seed or 0, len(g.row.output_token_ids) + j))
        p = probs[row]
        if j < len(g.draft):
            x = g.draft[j]
            u = torch.rand(1, generator=gen).item()
            if u < p[x].item():
                out.append(x)
                continue
            p = p.clone()
            p[x] = 0.0  # q is one-hot at x: max(p - q, 0) is p without x
        q = torch.empty_like(p).exponential_(generator=gen)
        out.append(int(p.div(q).argmax()))
        break
    return out

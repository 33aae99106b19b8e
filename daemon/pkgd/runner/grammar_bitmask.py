"""Apply the engine's grammar bitmask to the logits of constrained requests (structured outputs).

The engine core's `pkgd.engine.structured_output.StructuredOutputManager` fills one bitmask row
per constrained request that samples this step (`pkgd.scheduler_output.SchedulerOutput`); the
runner copies the rows to the logits' device and sets every disallowed token's logit to -inf
before the sampler runs, with xgrammar's kernels (its C++ loop on CPU, its Triton kernel on
CUDA). Unconstrained rows are not touched, so their tokens are exactly what they would be
alone. Like vLLM, logprobs are then those of the masked distribution.
"""

from __future__ import annotations

import torch

from pkgd.scheduler_output import SchedulerOutput


def apply_grammar_bitmask(
    logits: torch.Tensor, req_ids: list[str], scheduler_output: SchedulerOutput, positions: list[int] | None = None
) -> None:
    """Mask ``logits [N, V]`` (float, any device) in place for the rows of ``req_ids`` (N, the
    requests sampling this step, in ``logits`` row order) that have a bitmask row.
    ``positions[i]`` (default 0) is logits row i's verified position within its request's
    speculative proposal: it reads bitmask row ``structured_output_request_ids[req_id] + j``."""
    rows = scheduler_output.structured_output_request_ids
    if not rows or scheduler_output.grammar_bitmask is None:
        return
    pos = positions or [0] * len(req_ids)
    targets = [(i, rows[rid] + pos[i]) for i, rid in enumerate(req_ids) if rid in rows]
    if not targets:
        return
    import xgrammar as xgr

    # One row per constrained request, plus one per proposed token of a speculating one.
    drafts = scheduler_output.scheduled_spec_decode_tokens
    num_rows = len(rows) + sum(len(d) for rid, d in drafts.items() if rid in rows)
    packed = torch.frombuffer(bytearray(scheduler_output.grammar_bitmask), dtype=torch.int32).view(num_rows, -1)
    aligned = torch.full((logits.shape[0], packed.shape[1]), -1, dtype=torch.int32)
    index = [i for i, _ in targets]
    aligned[index] = packed[[r for _, r in targets]]
    vocab = min(logits.shape[1], packed.shape[1] * 32)
    xgr.apply_token_bitmask_inplace(
        logits, aligned.to(logits.device, non_blocking=True), vocab_size=vocab, indices=index
    )

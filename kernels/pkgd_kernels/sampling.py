"""Top-k and top-p (nucleus, Holtzman et al. 2020, "The Curious Case of Neural Text
Degeneration") filtering of logits, per request, before sampling.

For row ``s``: top-k keeps the tokens whose logit is at least the ``top_k[s]``-th largest;
top-p then keeps, from what top-k left (renormalised, as vLLM's sampler does), the smallest
set of most likely tokens whose probability mass reaches ``top_p[s]``. Everything else
becomes ``-inf``. Ties at either boundary are kept, so a row may keep more than ``k`` tokens:
the result is a function of the logits' values alone, never of their order, which keeps
batched and single-request sampling identical. ``top_k <= 0`` or ``>= V`` disables top-k,
``top_p >= 1`` disables top-p; ``top_p <= 0`` keeps only the most likely token(s).
"""

from __future__ import annotations

import torch

from pkgd_kernels._util import check_dtype, check_same, check_shape, triton_module, use_triton

_OP = "top_k_top_p_mask"
_BLOCK_V = 1024  # vocabulary entries per tile on GPU


def _check(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    check_shape(_OP, "logits", logits, [None, None])
    check_dtype(_OP, "logits", logits, [torch.float32])
    check_shape(_OP, "top_k", top_k, [logits.shape[0]])
    check_dtype(_OP, "top_k", top_k, [torch.int32])
    check_shape(_OP, "top_p", top_p, [logits.shape[0]])
    check_dtype(_OP, "top_p", top_p, [torch.float32])
    check_same(_OP, {"logits": logits, "top_k": top_k, "top_p": top_p}, dtype=False)


def top_k_top_p_mask_ref(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p sets to -inf (PyTorch reference: one
    sort per row, then thresholds read off the sorted values).

    Args:
        logits: float32 ``[S, V]``.
        top_k: int32 ``[S]``; 0 (or any value <= 0 or >= V) = off.
        top_p: float32 ``[S]``; 1.0 (or more) = off.

    Returns:
        A new float32 ``[S, V]``: kept logits unchanged, the rest ``-inf``.

    Raises:
        ValueError: shapes, dtypes or devices disagree.
    """
    _check(logits, top_k, top_p)
    num_rows, vocab = logits.shape
    if vocab == 0:
        return logits.clone()
    ordered = logits.sort(dim=-1, descending=True).values
    neg_inf = torch.full((num_rows, 1), float("-inf"), device=logits.device)
    k = top_k.long()[:, None]
    kth = ordered.gather(1, (k.clamp(1, vocab) - 1))
    k_threshold = torch.where((k > 0) & (k < vocab), kth, neg_inf)
    # Top-p over the top-k survivors: keep sorted entry j while the mass before it < top_p.
    probs = ordered.masked_fill(ordered < k_threshold, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    num_kept = (mass_before < top_p[:, None]).sum(dim=-1, keepdim=True).clamp(min=1)
    p_threshold = torch.where(top_p[:, None] < 1, ordered.gather(1, num_kept - 1), neg_inf)
    threshold = torch.maximum(k_threshold, p_threshold)
    return logits.masked_fill(logits < threshold, float("-inf"))


def top_k_top_p_mask_triton(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Triton version of :func:`top_k_top_p_mask_ref` (same arguments, result and errors),
    without a sort: one program per row bisects over the logits' values for the largest
    threshold that keeps at least ``k`` tokens, then for the largest that keeps mass
    ``top_p`` (each step one pass over the row; 32 steps pin a float32 value exactly).
    Masses are summed in another order than the reference's cumulative sum, so a row whose
    mass lands on ``top_p`` within rounding may keep one token more or fewer.
    """
    _check(logits, top_k, top_p)
    out = torch.empty_like(logits)
    if logits.numel() == 0:
        return out.copy_(logits)
    rows = logits if logits.stride(-1) == 1 else logits.contiguous()
    triton_module("sampling_triton").launch_top_k_top_p_mask(
        rows, top_k, top_p, out, block_v=min(_BLOCK_V, 1 << (rows.shape[1] - 1).bit_length())
    )
    return out


def top_k_top_p_mask(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k / top-p masking: :func:`top_k_top_p_mask_triton` on CUDA tensors,
    :func:`top_k_top_p_mask_ref` otherwise (see it for shapes and errors)."""
    if use_triton(logits):
        return top_k_top_p_mask_triton(logits, top_k, top_p)
    return top_k_top_p_mask_ref(logits, top_k, top_p)

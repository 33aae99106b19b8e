"""Triton kernel behind :mod:`pkgd_kernels.sampling` (imports Triton).

Each float32 logit maps to an int32 key with the same order (IEEE-754 bits, negative values'
magnitude bits flipped; both zeros map to 0), so a threshold search is an integer bisection
that ends on an exact logit value after at most 33 halvings of the key range. Program s:

1. one pass: largest and smallest key of row s;
2. top-k: largest key t with ``count(key >= t) >= k`` (the k-th largest logit, ties kept);
3. top-p: with ``w = exp(x - max)`` summed over the top-k survivors as ``Z``, the largest key
   t >= that with ``sum(w[key >= t]) >= top_p * Z`` (the nucleus boundary, ties kept);
4. one pass writing ``x`` where ``key >= threshold`` and ``-inf`` elsewhere.

The row stays in L2 across the passes; no sort and no scratch memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _order_key(x):
    """int32 key ordered like the float32 ``x`` (-0.0 and 0.0 share key 0)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x == 0.0, 0, key)


@triton.jit
def _count_at_least(row_ptr, vocab, t, BLOCK_V: tl.constexpr):
    count = tl.zeros([BLOCK_V], tl.int32)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
        count += ((_order_key(x) >= t) & (cols < vocab)).to(tl.int32)
    return tl.sum(count, axis=0)


@triton.jit
def _mass_at_least(row_ptr, vocab, t, x_max, BLOCK_V: tl.constexpr):
    mass = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
        mass += tl.where(_order_key(x) >= t, tl.exp(x - x_max), 0.0)
    return tl.sum(mass, axis=0)


@triton.jit
def _top_k_top_p_kernel(
    logits_ptr,
    top_k_ptr,
    top_p_ptr,
    out_ptr,
    stride_l,
    stride_o,
    vocab,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l
    k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    key_max = tl.full([BLOCK_V], -(2**31), tl.int32)
    key_min = tl.full([BLOCK_V], 2**31 - 1, tl.int32)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        key = _order_key(tl.load(row_ptr + cols, mask=cols < vocab, other=0.0))
        key_max = tl.maximum(key_max, tl.where(cols < vocab, key, -(2**31)))
        key_min = tl.minimum(key_min, tl.where(cols < vocab, key, 2**31 - 1))
    hi = tl.max(key_max, axis=0).to(tl.int64)
    lo = tl.min(key_min, axis=0).to(tl.int64)
    if (k > 0) & (k < vocab):
        while lo < hi:  # invariant: count(key >= lo) >= k, count(key >= hi + 1) < k
            mid = lo + (hi - lo + 1) // 2
            if _count_at_least(row_ptr, vocab, mid, BLOCK_V) >= k:
                lo = mid
            else:
                hi = mid - 1
        hi = tl.max(key_max, axis=0).to(tl.int64)
    if top_p < 1.0:
        # Largest logit (key hi): its float value via the inverse key map, for exp(x - max).
        hi32 = hi.to(tl.int32)
        x_max = tl.where(hi32 < 0, hi32 ^ 0x7FFFFFFF, hi32).to(tl.float32, bitcast=True)
        x_max = tl.where(x_max == float("-inf"), 0.0, x_max)  # all -inf: no NaN from inf - inf
        target = top_p * _mass_at_least(row_ptr, vocab, lo, x_max, BLOCK_V)
        while lo < hi:  # invariant: mass(key >= lo) >= target
            mid = lo + (hi - lo + 1) // 2
            if _mass_at_least(row_ptr, vocab, mid, x_max, BLOCK_V) >= target:
                lo = mid
            else:
                hi = mid - 1
    threshold = lo.to(tl.int32)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=0.0)
        out = tl.where(_order_key(x) >= threshold, x, float("-inf"))
        tl.store(out_ptr + row * stride_o + cols, out, mask=cols < vocab)


def launch_top_k_top_p_mask(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    out: torch.Tensor,
    *,
    block_v: int,
) -> None:
    """Launch on checked inputs (``logits`` with unit column stride) into ``out``;
    ``block_v`` a power of 2."""
    _top_k_top_p_kernel[(logits.shape[0],)](
        logits,
        top_k,
        top_p,
        out,
        logits.stride(0),
        out.stride(0),
        logits.shape[1],
        BLOCK_V=block_v,
        num_warps=min(max(block_v // 256, 1), 8),
    )

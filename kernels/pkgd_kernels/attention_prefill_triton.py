"""Triton kernel behind :func:`pkgd_kernels.attention.paged_attention_prefill_triton`
(imports Triton).

Program (b, h) takes query tile b of the flattened batch for query head h. Sequence s owns
tiles ``[qsl[s] // BLOCK_M + s, qsl[s + 1] // BLOCK_M + s + 1)`` (``qsl`` = query_start_loc):
at least ``ceil(q_len / BLOCK_M)`` of them, in order, so a grid of ``T // BLOCK_M + S`` tiles
covers every sequence without reading lengths on the host, and surplus tiles exit at once.
A program finds its sequence by binary search, then sweeps keys ``0..min(seq_len, last row's
position + 1)`` from the paged cache in tiles of BLOCK_N with an online softmax
(FlashAttention, Dao et al. 2022), masking keys after each row's position (causal) and after
``seq_len``. Cached context (chunked prefill, prefix hits) is just keys before the first row.

A sliding window W starts the sweep at the tile's first row's ``position - W + 1`` and masks
keys ``<= position - W`` per row; a row may then see no key in a whole tile, so the running
max is taken as 0 while it is still -inf (no ``exp(-inf - -inf)``). A soft cap c maps each
score to ``c * tanh(score / c)``. Both are compile-time switches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pkgd_kernels._util import next_power_of_2
from pkgd_kernels.attention_decode_triton import _soft_cap

BLOCK_M = 64  # query rows per program on GPU (half for float32: 2x the shared memory per tile)
BLOCK_N = 64  # keys per inner tile on GPU (likewise)


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_M: tl.constexpr):
    """Largest s with ``query_start_loc[s] // BLOCK_M + s <= tile`` (binary search)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    scale,
    sliding_window,
    soft_cap,
    num_seqs,
    stride_q_t,
    stride_q_h,
    stride_kc_b,
    stride_kc_o,
    stride_kc_h,
    stride_vc_b,
    stride_vc_o,
    stride_vc_h,
    stride_bt_s,
    stride_o_t,
    stride_o_h,
    group_size,
    head_dim,
    block_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_M)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_row = (tile - (q_start // BLOCK_M + seq)) * BLOCK_M
    if first_row >= q_len:  # surplus tile
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len
    kv_head = head // group_size
    rows = first_row + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    positions = context + rows
    dims = tl.arange(0, D_PAD)
    dim_mask = dims < head_dim
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_q_t + head * stride_q_h + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_end = tl.minimum(seq_len, context + first_row + BLOCK_M)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(context + first_row - sliding_window + 1, 0)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs < kv_end
        block = tl.load(table + offs // block_size, mask=n_mask, other=0).to(tl.int64)
        in_block = offs % block_size
        kv_mask = n_mask[:, None] & dim_mask[None, :]
        k_off = block * stride_kc_b + in_block * stride_kc_o + kv_head * stride_kc_h
        k = tl.load(k_cache_ptr + k_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if HAS_SOFT_CAP:
            scores = _soft_cap(scores, soft_cap)
        causal = (offs[None, :] <= positions[:, None]) & n_mask[None, :]
        if HAS_WINDOW:
            causal = causal & (offs[None, :] > positions[:, None] - sliding_window)
        scores = tl.where(causal, scores, float("-inf"))
        # Without a window, key 0 is in the first tile and visible to every row, so m is finite
        # from then on; with one, a row may still have seen nothing (m = -inf): use 0 as its max.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        if HAS_WINDOW:
            m_new = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v_off = block * stride_vc_b + in_block * stride_vc_o + kv_head * stride_vc_h
        v = tl.load(v_cache_ptr + v_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    dst = out_ptr + tokens[:, None] * stride_o_t + head * stride_o_h + dims[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def launch_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> None:
    """Launch on checked inputs (``query`` with unit last-dim stride) into ``out``;
    ``block_m``, ``block_n`` powers of 2, >= 16 (``tl.dot``'s minimum); None =
    :data:`BLOCK_M` / :data:`BLOCK_N`, halved for float32; ``sliding_window``, ``soft_cap`` as
    in `pkgd_kernels.attention` (0 = off)."""
    shrink = 2 if query.dtype == torch.float32 else 1
    block_m = block_m or BLOCK_M // shrink
    block_n = block_n or BLOCK_N // shrink
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, _ = key_cache.shape
    for cache in (key_cache, value_cache):
        if cache.stride(-1) != 1:
            raise ValueError("paged_attention_prefill: the KV cache needs unit last-dim stride")
    if num_seqs == 0:
        return
    grid = (num_tokens // block_m + num_seqs, num_heads)
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale,
        sliding_window,
        float(soft_cap),
        num_seqs,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads // num_kv_heads,
        head_dim,
        block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        D_PAD=max(16, next_power_of_2(head_dim)),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        HAS_WINDOW=sliding_window > 0,
        HAS_SOFT_CAP=soft_cap > 0,
        num_warps=4 if block_m * max(16, next_power_of_2(head_dim)) <= 64 * 64 else 8,
    )

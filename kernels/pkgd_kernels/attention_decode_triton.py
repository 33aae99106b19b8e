"""Triton kernels behind :func:`pkgd_kernels.attention.paged_attention_decode_triton`
(imports Triton).

Program (s, kv_head, p) holds the ``G = num_heads // num_kv_heads`` query rows of KV head
``kv_head`` for sequence ``s`` as one ``[G_PAD, D_PAD]`` tile and sweeps keys
``[p * PARTITION, min((p + 1) * PARTITION, seq_len))`` in tiles of BLOCK_N tokens, each token's
address taken from the block table, keeping a running max ``m``, sum ``l`` and output ``acc``
(online softmax, Dao et al. 2022). With one partition the program writes ``acc / l``; with
several it writes ``(m, l, acc)`` and ``_reduce_kernel`` rescales and sums them
(vLLM's paged attention v2, flash-decoding). Tiles are padded to 16 for ``tl.dot``.

A sliding window W starts each sequence's sweep at key ``seq_len - W``: partitions wholly
before it exit at once and the reducer skips them (its first partition is
``(seq_len - W) // PARTITION``). A soft cap c maps each score to ``c * tanh(score / c)``.
Both are compile-time switches, so the plain kernel is unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pkgd_kernels._util import next_power_of_2

PARTITION_SIZE = 512  # keys per partition when a context is split (vLLM v2 uses 512)
BLOCK_N = 64  # keys per inner tile on GPU (half that for float32, whose tiles take 2x the
# shared memory: 78 KB at head_dim 128 with 64, more than consumer GPUs' 99 KB once pipelined)


@triton.jit
def _soft_cap(scores, cap):
    """``cap * tanh(scores / cap)``, tanh written with ``exp`` (saturates to +-1, no NaN)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * scores / cap) + 1.0))


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    scale,
    sliding_window,
    soft_cap,
    num_partitions,
    stride_q_s,
    stride_q_h,
    stride_kc_b,
    stride_kc_o,
    stride_kc_h,
    stride_vc_b,
    stride_vc_o,
    stride_vc_h,
    stride_bt_s,
    stride_o_s,
    stride_o_h,
    group_size,
    head_dim,
    block_size,
    partition_size,
    G_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * partition_size
    if not SINGLE:
        if start >= seq_len:  # beyond this context: the reducer skips it
            return
    end = tl.minimum(start + partition_size, seq_len)
    lo = start
    if HAS_WINDOW:
        lo = tl.maximum(start, seq_len - sliding_window)
        if not SINGLE:
            if end <= lo:  # wholly before the window: the reducer skips it
                return
    rows = tl.arange(0, G_PAD)
    dims = tl.arange(0, D_PAD)
    heads = kv_head * group_size + rows
    row_mask = rows < group_size
    dim_mask = dims < head_dim
    q = tl.load(
        q_ptr + seq * stride_q_s + heads[:, None] * stride_q_h + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for n0 in range(lo, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs < end
        block = tl.load(block_tables_ptr + seq * stride_bt_s + offs // block_size, mask=n_mask, other=0).to(tl.int64)
        in_block = offs % block_size
        kv_mask = n_mask[:, None] & dim_mask[None, :]
        k_off = block * stride_kc_b + in_block * stride_kc_o + kv_head * stride_kc_h
        k = tl.load(k_cache_ptr + k_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if HAS_SOFT_CAP:
            scores = _soft_cap(scores, soft_cap)
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v_off = block * stride_vc_b + in_block * stride_vc_o + kv_head * stride_vc_h
        v = tl.load(v_cache_ptr + v_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    out_mask = row_mask[:, None] & dim_mask[None, :]
    if SINGLE:
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]  # empty sequence -> zeros
        dst = out_ptr + seq * stride_o_s + heads[:, None] * stride_o_h + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # partials are contiguous [S, num_heads, num_partitions(, D_PAD)]
        slot = (seq * tl.num_programs(1) * group_size + heads) * num_partitions + part
        tl.store(part_m_ptr + slot, m, mask=row_mask)
        tl.store(part_l_ptr + slot, l_sum, mask=row_mask)
        tl.store(part_acc_ptr + slot[:, None] * D_PAD + dims[None, :], acc, mask=out_mask)


@triton.jit
def _reduce_kernel(
    seq_lens_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    num_partitions,
    stride_o_s,
    stride_o_h,
    head_dim,
    partition_size,
    sliding_window,
    P_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    # Program (s, h) merges the partitions that hold keys: weight_p = exp(m_p - max m).
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    used = tl.cdiv(seq_len, partition_size)
    parts = tl.arange(0, P_PAD)
    dims = tl.arange(0, D_PAD)
    p_mask = parts < used
    if HAS_WINDOW:
        p_mask = p_mask & (parts >= tl.maximum(seq_len - sliding_window, 0) // partition_size)
    base = (seq * tl.num_programs(1) + head) * num_partitions
    m = tl.load(part_m_ptr + base + parts, mask=p_mask, other=float("-inf"))
    l_sum = tl.load(part_l_ptr + base + parts, mask=p_mask, other=0.0)
    acc = tl.load(part_acc_ptr + (base + parts)[:, None] * D_PAD + dims[None, :], mask=p_mask[:, None], other=0.0)
    m_max = tl.maximum(tl.max(m, axis=0), -1e30)  # finite even for an empty sequence
    weight = tl.where(p_mask, tl.exp(m - m_max), 0.0)
    total = tl.sum(l_sum * weight, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    dst = out_ptr + seq * stride_o_s + head * stride_o_h + dims
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


def launch_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    partition_size: int | None = None,
    block_n: int | None = None,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> None:
    """Launch on checked inputs (``query`` with unit last-dim stride) into ``out``;
    ``sliding_window``, ``soft_cap`` as in `pkgd_kernels.attention` (0 = off).

    ``partition_size`` (a multiple of ``block_n``; None = :data:`PARTITION_SIZE` when the
    block table can hold more keys than that, else no split) sets the split of long contexts;
    ``block_n`` (power of 2, >= 16; None = :data:`BLOCK_N`, halved for float32) the keys per
    inner tile.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    for cache in (key_cache, value_cache):
        if cache.stride(-1) != 1:
            raise ValueError("paged_attention_decode: the KV cache needs unit last-dim stride")
    if block_n is None:
        block_n = BLOCK_N // 2 if query.dtype == torch.float32 else BLOCK_N
    capacity = block_tables.shape[1] * block_size
    if partition_size is None:
        partition_size = PARTITION_SIZE if capacity > PARTITION_SIZE else max(capacity, 1)
    num_partitions = triton.cdiv(max(capacity, 1), partition_size)
    d_pad = max(16, next_power_of_2(head_dim))
    group = num_heads // num_kv_heads
    single = num_partitions == 1
    parts = (num_seqs, num_heads, num_partitions)
    part_m = out if single else torch.empty(parts, dtype=torch.float32, device=out.device)
    part_l = out if single else torch.empty(parts, dtype=torch.float32, device=out.device)
    part_acc = out if single else torch.empty((*parts, d_pad), dtype=torch.float32, device=out.device)
    _decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        out,
        part_m,
        part_l,
        part_acc,
        scale,
        sliding_window,
        float(soft_cap),
        num_partitions,
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
        group,
        head_dim,
        block_size,
        partition_size,
        G_PAD=max(16, next_power_of_2(group)),
        D_PAD=d_pad,
        BLOCK_N=block_n,
        SINGLE=single,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        HAS_WINDOW=sliding_window > 0,
        HAS_SOFT_CAP=soft_cap > 0,
    )
    if not single:
        _reduce_kernel[(num_seqs, num_heads)](
            seq_lens,
            part_m,
            part_l,
            part_acc,
            out,
            num_partitions,
            out.stride(0),
            out.stride(1),
            head_dim,
            partition_size,
            sliding_window,
            P_PAD=next_power_of_2(num_partitions),
            D_PAD=d_pad,
            HAS_WINDOW=sliding_window > 0,
        )

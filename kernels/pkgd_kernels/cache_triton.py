"""Triton kernel behind :func:`pkgd_kernels.cache.reshape_and_cache_triton` (imports Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_k_t,
    stride_k_h,
    stride_k_d,
    stride_v_t,
    stride_v_h,
    stride_v_d,
    stride_kc_b,
    stride_kc_o,
    stride_kc_h,
    stride_kc_d,
    stride_vc_b,
    stride_vc_o,
    stride_vc_h,
    stride_vc_d,
    block_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Program (t, j) copies heads [j*BLOCK_H, (j+1)*BLOCK_H) of token t, all head_dim lanes.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding token: not cached
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    src_k = key_ptr + token * stride_k_t + heads[:, None] * stride_k_h + dims[None, :] * stride_k_d
    src_v = value_ptr + token * stride_v_t + heads[:, None] * stride_v_h + dims[None, :] * stride_v_d
    dst_k = (
        key_cache_ptr
        + block * stride_kc_b
        + offset * stride_kc_o
        + heads[:, None] * stride_kc_h
        + dims[None, :] * stride_kc_d
    )
    dst_v = (
        value_cache_ptr
        + block * stride_vc_b
        + offset * stride_vc_o
        + heads[:, None] * stride_vc_h
        + dims[None, :] * stride_vc_d
    )
    tl.store(dst_k, tl.load(src_k, mask=mask), mask=mask)
    tl.store(dst_v, tl.load(src_v, mask=mask), mask=mask)


def launch_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    block_h: int,
    block_d: int,
) -> None:
    """Launch on checked inputs; ``block_h``, ``block_d`` powers of 2, ``block_d >= head_dim``."""
    num_tokens, num_kv_heads, head_dim = key.shape
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _reshape_and_cache_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        key_cache.shape[1],
        num_kv_heads,
        head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )

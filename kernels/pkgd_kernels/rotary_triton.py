"""Triton kernel behind :mod:`pkgd_kernels.rotary` (imports Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    positions_ptr,
    x_ptr,
    out_ptr,
    cos_sin_ptr,
    stride_x,
    stride_out,
    stride_cs,
    num_heads,
    head_size,
    rot_dim,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Program (t, j) writes heads [j*BLOCK_H, (j+1)*BLOCK_H) of token t. Channel d < rot_dim
    # reads its pair partner p(d) and table column c(d):
    #   out[d] = x[d] * cos[c(d)] + sign(d) * x[p(d)] * sin[c(d)]
    # channels d >= rot_dim are copied.
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    half = rot_dim // 2
    if IS_NEOX:  # pairs (i, i + half)
        first = dims < half
        col = tl.where(first, dims, dims - half)
        partner = tl.where(first, dims + half, dims - half)
    else:  # pairs (2i, 2i + 1)
        first = dims % 2 == 0
        col = dims // 2
        partner = tl.where(first, dims + 1, dims - 1)
    rotated = dims < rot_dim
    cos = tl.load(cos_sin_ptr + pos * stride_cs + col, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + col, mask=rotated, other=0.0)
    sin = tl.where(first, -sin.to(tl.float32), sin.to(tl.float32))
    head_mask = heads[:, None] < num_heads
    mask = head_mask & (dims[None, :] < head_size)
    row = x_ptr + token * stride_x + heads[:, None] * head_size
    x = tl.load(row + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(row + partner[None, :], mask=head_mask & rotated[None, :], other=0.0)
    out = x * cos[None, :] + x_partner.to(tl.float32) * sin[None, :]
    dst = out_ptr + token * stride_out + heads[:, None] * head_size + dims[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)


def launch_rotary_embedding(
    positions: torch.Tensor,
    x: torch.Tensor,
    out: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    *,
    block_h: int,
    block_d: int,
) -> None:
    """Rotate checked ``x`` ``[T, H*head_size]`` (unit last-dim stride) into contiguous ``out``;
    ``block_h``, ``block_d`` powers of 2 with ``block_d >= head_size``."""
    num_heads = x.shape[1] // head_size
    grid = (x.shape[0], triton.cdiv(num_heads, block_h))
    _rotary_kernel[grid](
        positions,
        x,
        out,
        cos_sin_cache,
        x.stride(0),
        out.stride(0),
        cos_sin_cache.stride(0),
        num_heads,
        head_size,
        cos_sin_cache.shape[1],
        IS_NEOX=is_neox,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )

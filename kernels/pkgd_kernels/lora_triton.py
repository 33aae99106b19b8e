"""Triton kernels behind :mod:`pkgd_kernels.lora` (imports Triton): Punica's BGMV shrink and
expand, one program per token (and block of outputs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_K = 64
_BLOCK_N = 64


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slots_ptr, out_ptr, k, r,
    stride_x, stride_as, stride_ar, stride_out,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # out[t, :] = A[slot_t] @ x[t] in float32; rows of slot -1 are never read by the expand.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    rows = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + t * stride_x + cols, mask=cols < k, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + slot * stride_as + rows[:, None] * stride_ar + cols[None, :],
            mask=(rows[:, None] < r) & (cols[None, :] < k),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a * xv[None, :], axis=1)
    tl.store(out_ptr + t * stride_out + rows, acc, mask=rows < r)


@triton.jit
def _expand_kernel(
    y_ptr, b_ptr, slots_ptr, shrink_ptr, n, r,
    stride_y, stride_bs, stride_bn, stride_shrink,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # y[t, block] += B[slot_t][block, :] @ shrink[t], accumulated in float32, rounded once.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    v = tl.load(shrink_ptr + t * stride_shrink + rs, mask=rs < r, other=0.0)
    b = tl.load(
        b_ptr + slot * stride_bs + ns[:, None] * stride_bn + rs[None, :],
        mask=(ns[:, None] < n) & (rs[None, :] < r),
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(b * v[None, :], axis=1)
    y_row = y_ptr + t * stride_y + ns
    old = tl.load(y_row, mask=ns < n, other=0.0).to(tl.float32)
    tl.store(y_row, (old + delta).to(y_ptr.dtype.element_ty), mask=ns < n)


def launch_add_lora(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor, *, block_r: int
) -> None:
    """Shrink into a float32 ``[T, R]`` scratch, then expand into ``y`` (strided rows allowed)."""
    t, k = x.shape
    _, r, _ = lora_a.shape
    n = y.shape[1]
    shrink = torch.empty(t, r, dtype=torch.float32, device=x.device)
    _shrink_kernel[(t,)](
        x, lora_a, slots, shrink, k, r,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), shrink.stride(0),
        BLOCK_R=block_r, BLOCK_K=_BLOCK_K,
    )  # fmt: skip
    _expand_kernel[(t, triton.cdiv(n, _BLOCK_N))](
        y, lora_b, slots, shrink, n, r,
        y.stride(0), lora_b.stride(0), lora_b.stride(1), shrink.stride(0),
        BLOCK_R=block_r, BLOCK_N=_BLOCK_N,
    )  # fmt: skip

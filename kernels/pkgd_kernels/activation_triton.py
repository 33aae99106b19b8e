"""Triton kernel behind :mod:`pkgd_kernels.activation` (imports Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, inter, BLOCK: tl.constexpr):
    # Program (t, j) computes columns [j*BLOCK, (j+1)*BLOCK) of row t, in float32.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def launch_silu_and_mul(x: torch.Tensor, out: torch.Tensor, *, block: int) -> None:
    """Launch on a checked ``[T, 2*I]`` input with unit column stride into ``out`` ``[T, I]``."""
    inter = out.shape[1]
    grid = (x.shape[0], triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4 if block >= 512 else 1
    )


@triton.jit
def _gelu_tanh_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, inter, BLOCK: tl.constexpr):
    # As _silu_and_mul_kernel, with GELU's tanh form: tanh(u) = 1 - 2 / (exp(2u) + 1).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi)
    out = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def launch_gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor, *, block: int) -> None:
    """As `launch_silu_and_mul`, for `pkgd_kernels.gelu_tanh_and_mul`."""
    inter = out.shape[1]
    grid = (x.shape[0], triton.cdiv(inter, block))
    _gelu_tanh_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4 if block >= 512 else 1
    )

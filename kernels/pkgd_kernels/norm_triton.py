"""Triton kernel behind :mod:`pkgd_kernels.norm` (imports Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    stride_x,
    stride_res,
    stride_out,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
):
    # One program per row. Rows no wider than BLOCK stay in registers (one read, one write);
    # wider rows take a second pass that re-reads the summed row this program just wrote.
    # Arithmetic is float32 with a rounding to the model dtype wherever torch's bf16/fp16
    # ops would round (after the residual add, after normalising, after the weight).
    dtype = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    res_row = res_ptr + row * stride_res
    out_row = out_ptr + row * stride_out
    new_res_row = new_res_ptr + row * stride_out
    cols = tl.arange(0, BLOCK)
    if SINGLE_PASS:  # hidden <= BLOCK
        mask = cols < hidden
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x = (x + tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype)
            tl.store(new_res_row + cols, x, mask=mask)
            x = x.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
        w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
        tl.store(out_row + cols, ((x * inv_rms).to(dtype).to(tl.float32) * w).to(dtype), mask=mask)
    else:
        sum_sq = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            mask = start + cols < hidden
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                x = x + tl.load(res_row + start + cols, mask=mask, other=0.0).to(tl.float32)
                x = x.to(dtype)
                tl.store(new_res_row + start + cols, x, mask=mask)
                x = x.to(tl.float32)
            sum_sq += x * x
        inv_rms = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / hidden + eps)
        if HAS_RESIDUAL:
            tl.debug_barrier()  # the summed row written above is read back by other threads
            x_row = new_res_row
        for start in range(0, hidden, BLOCK):
            mask = start + cols < hidden
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + start + cols, mask=mask).to(tl.float32)
            y = (x * inv_rms).to(dtype).to(tl.float32) * w
            tl.store(out_row + start + cols, y.to(dtype), mask=mask)


def launch_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    new_residual: torch.Tensor | None,
    eps: float,
    *,
    block: int,
) -> None:
    """Launch on checked 2-D inputs with unit column stride; ``out``/``new_residual`` are
    contiguous ``[T, H]``; ``block`` is a power of 2 (rows wider than it take two passes)."""
    for t in (x, residual, out, new_residual):
        if t is not None and t.stride(-1) != 1:
            raise ValueError("launch_rms_norm: rows must have unit column stride")
    has_residual = residual is not None
    if not has_residual:  # unused pointers; any valid tensor of the right dtype will do
        residual, new_residual = x, out
    assert residual is not None
    _rms_norm_kernel[(x.shape[0],)](
        x,
        residual,
        weight,
        out,
        new_residual,
        x.stride(0),
        residual.stride(0),
        out.stride(0),
        x.shape[1],
        eps,
        BLOCK=block,
        HAS_RESIDUAL=has_residual,
        SINGLE_PASS=x.shape[1] <= block,
        num_warps=min(max(block // 256, 1), 16),
    )

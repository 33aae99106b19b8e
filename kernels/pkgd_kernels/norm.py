"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"), plain and fused with
the residual add that precedes it in a pre-norm transformer block.

``rms_norm(x) = x / sqrt(mean(x**2) + eps) * weight`` over the last dim. The statistics are taken
in float32 and the normalised value is rounded to ``x.dtype`` before the weight multiplies it,
as Hugging Face's ``LlamaRMSNorm`` does, so bf16/fp16 results match the models' own forward.
Inputs are ``[T, H]`` (more leading dims are accepted and kept).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pkgd_kernels._util import (
    FLOAT_DTYPES,
    check_dtype,
    check_same,
    check_shape,
    next_power_of_2,
    on_device,
    triton_module,
    unit_stride,
    use_triton,
)

_MAX_BLOCK = 4096  # widest row tile; wider rows take two passes over the row


def _check(op: str, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have shape [T, H] with H > 0, got {list(x.shape)}")
    check_dtype(op, "x", x, FLOAT_DTYPES)
    check_shape(op, "weight", weight, [x.shape[-1]])
    check_same(op, {"x": x, "weight": weight})
    if not eps >= 0:  # also rejects NaN
        raise ValueError(f"{op}: eps must be >= 0, got {eps}")


def _check_residual(op: str, x: torch.Tensor, residual: torch.Tensor) -> None:
    check_shape(op, "residual", residual, list(x.shape))
    check_same(op, {"x": x, "residual": residual})


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row (PyTorch reference).

    Args:
        x: ``[T, H]`` float32/float16/bfloat16 (any leading dims).
        weight: ``[H]``, same dtype and device as ``x``.
        eps: added to the mean square, >= 0 (1e-5 or 1e-6 in Llama/Qwen configs).

    Returns:
        A new ``[T, H]`` tensor, ``x.dtype``.

    Raises:
        ValueError: shapes, dtypes or devices disagree, or eps < 0.
    """
    _check("rms_norm", x, weight, eps)
    return _rms_norm(x, weight, eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x32 * inv_rms).to(x.dtype) * weight


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm (PyTorch reference).

    Args:
        x: ``[T, H]`` float32/float16/bfloat16, the sublayer's output (any leading dims).
        residual: ``[T, H]``, the running residual stream; same dtype and device.
        weight: ``[H]``; eps: as in :func:`rms_norm_ref`.

    Returns:
        ``(out, new_residual)``, new tensors: ``new_residual = x + residual`` (rounded to
        ``x.dtype``) and ``out = rms_norm(new_residual, weight, eps)``.

    Raises:
        ValueError: shapes, dtypes or devices disagree, or eps < 0.
    """
    _check("fused_add_rms_norm", x, weight, eps)
    _check_residual("fused_add_rms_norm", x, residual)
    new_residual = x + residual
    return _rms_norm(new_residual, weight, eps), new_residual


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, H]`` with unit column stride: a view for the usual inputs."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    rows = _rows(x)
    res_rows = None if residual is None else _rows(residual)
    out = torch.empty_like(rows, memory_format=torch.contiguous_format)
    new_res = None if residual is None else torch.empty_like(out)
    if rows.shape[0] > 0:
        with on_device(x):
            triton_module("norm_triton").launch_rms_norm(
                rows,
                res_rows,
                unit_stride(weight),
                out,
                new_res,
                eps,
                block=min(next_power_of_2(hidden), _MAX_BLOCK),
            )
    shape = x.shape
    return out.view(shape), None if new_res is None else new_res.view(shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of :func:`rms_norm_ref` (same arguments, result and errors): one program
    per row, float32 statistics."""
    _check("rms_norm", x, weight, eps)
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`fused_add_rms_norm_ref` (same arguments, results and errors):
    one pass reads ``x`` and ``residual`` once and writes both outputs."""
    _check("fused_add_rms_norm", x, weight, eps)
    _check_residual("fused_add_rms_norm", x, residual)
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """CPU form of :func:`rms_norm_ref` (same arguments and result; arguments unchecked, as
    the dispatcher checks them): float32 rows through ``F.rms_norm`` (one fused ATen op),
    16-bit ones normalised in float32 and rounded before the weight multiplies them."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def fused_add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU form of :func:`fused_add_rms_norm_ref` (same arguments and results; unchecked)."""
    new_residual = x + residual
    return rms_norm_cpu(new_residual, weight, eps), new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, kernels=None) -> torch.Tensor:
    """RMSNorm: :func:`rms_norm_triton` on CUDA tensors; on CPU the C form when ``kernels`` (a
    `pkgd_kernels.cpu.CpuKernels`) takes the tensors, else :func:`rms_norm_cpu` (arguments and
    errors as :func:`rms_norm_ref`)."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps)
    _check("rms_norm", x, weight, eps)
    if kernels is not None and kernels.takes_rms_norm(x, weight):
        return kernels.rms_norm(x, weight, eps)
    return rms_norm_cpu(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, kernels=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual; out = rms_norm(new_residual)``:
    :func:`fused_add_rms_norm_triton` on CUDA tensors; on CPU the C form when ``kernels`` takes
    the tensors, else :func:`fused_add_rms_norm_cpu` (arguments and errors as
    :func:`fused_add_rms_norm_ref`).
    """
    if use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    _check("fused_add_rms_norm", x, weight, eps)
    _check_residual("fused_add_rms_norm", x, residual)
    if kernels is not None and kernels.takes_rms_norm(x, weight) and residual.dtype == x.dtype:
        return kernels.fused_add_rms_norm(x, residual, weight, eps)
    return fused_add_rms_norm_cpu(x, residual, weight, eps)

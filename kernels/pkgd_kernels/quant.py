"""Linear layers and embedding lookups on GGUF quantized weights, kept quantized.

The weight is a `pkgd_kernels.quant_layout.QuantWeight` (GGUF's ``Q4_0``, ``Q4_1``, ``Q8_0``,
``Q4_K`` or ``Q6_K`` blocks, repacked 16 rows at a time; that module documents the layout).

Ops (CPU only; a PyTorch reference and a C form, `pkgd_kernels.cpu.CpuKernels`):

* ``quant_linear(x [M, K], weight, bias [N] | None) -> [M, N]``: ``x @ W^T + bias`` with the
  activations quantized to int8 first, llama.cpp's scheme for its CPU matmuls
  (``quantize_row_q8_1`` / ``q8_K``): per block of 32 inputs (types ``Q4_0/Q4_1/Q8_0``) or 256
  (``Q4_K/Q6_K``), ``dx = max|x| / 127`` and ``q = round(x / dx)`` to nearest even. The C form
  then multiplies int8 by the weights' integers exactly (``vpdpbusd``) and scales per block, so
  it computes the reference's ``quantize_activations(x) @ dequantize(W)^T`` up to the order of
  the float sums. The activation rounding itself moves each input by at most ``dx / 2``, i.e.
  ``max|x| / 254`` of its block.
* ``quant_gather(weight, ids [T]) -> [T, K]``: rows ``W[ids]`` in float32 (an embedding
  lookup; a tied LM head's table).
"""

from __future__ import annotations

import torch

from pkgd_kernels._util import check_dtype, check_shape
from pkgd_kernels.quant_layout import BLOCK, QuantWeight, dequantize

_LINEAR = "quant_linear"
_GATHER = "quant_gather"


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's int8 activations: ``x [M, K]`` (K a multiple of ``block``) -> ``(q int8
    [M, K], dx float32 [M, K / block])`` with ``x ≈ q * dx`` per block; ``dx = max|x| / 127``,
    ``q = round(x * (1 / dx))`` (nearest even), 0 for an all-zero block."""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, 1.0), 0.0)
    q = (xb * inv.unsqueeze(-1)).round().clamp(-127, 127)
    return q.to(torch.int8).reshape(m, k), d


def dequantized_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` as the kernels see it: `quantize_activations` multiplied back out (float32)."""
    q, d = quantize_activations(x, block)
    m, k = x.shape
    return (q.float().reshape(m, k // block, block) * d.unsqueeze(-1)).reshape(m, k)


def _check_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None) -> None:
    if not isinstance(weight, QuantWeight):
        raise ValueError(f"{_LINEAR}: weight must be a QuantWeight, got {type(weight).__name__}")
    check_shape(_LINEAR, "x", x, [None, weight.k])
    check_dtype(_LINEAR, "x", x, [torch.float32, torch.bfloat16, torch.float16])
    if bias is not None:
        check_shape(_LINEAR, "bias", bias, [weight.n])


def quant_linear_ref(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with int8 activations (PyTorch reference: the module docstring).

    Args:
        x: ``[M, K]``, float32/bfloat16/float16, any strides.
        weight: the quantized ``W [N, K]``.
        bias: ``[N]`` or None.

    Returns:
        A new ``[M, N]`` in ``x``'s dtype (computed in float32).

    Raises:
        ValueError: shapes or dtypes that do not fit.
    """
    _check_linear(x, weight, bias)
    w = dequantize(weight)
    outs, row = [], 0
    for seg in weight.segments:
        rows = min(seg.rows, weight.n - row)
        outs.append(dequantized_activations(x, BLOCK[seg.qtype]) @ w[row : row + rows].t())
        row += rows
    y = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None, *, kernels=None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` on the quantized weight: the C form when ``kernels`` (a
    `pkgd_kernels.cpu.CpuKernels`) takes the tensors, else :func:`quant_linear_ref` (shapes and
    errors there)."""
    _check_linear(x, weight, bias)
    if kernels is not None and kernels.takes_quant_linear(x, weight):
        return kernels.quant_linear(x, weight, bias)
    return quant_linear_ref(x, weight, bias)


def _check_gather(weight: QuantWeight, ids: torch.Tensor) -> None:
    if not isinstance(weight, QuantWeight):
        raise ValueError(f"{_GATHER}: weight must be a QuantWeight, got {type(weight).__name__}")
    check_shape(_GATHER, "ids", ids, [None])
    check_dtype(_GATHER, "ids", ids, [torch.int64])


def quant_gather_ref(weight: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``W[ids]`` of the quantized matrix (PyTorch reference).

    Args:
        weight: the quantized ``W [N, K]``.
        ids: int64 ``[T]`` in ``[0, N)``.

    Returns:
        A new float32 ``[T, K]``.

    Raises:
        ValueError: shapes or dtypes that do not fit.
        IndexError: an id outside ``[0, N)`` (nothing is read).
    """
    _check_gather(weight, ids)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.n):
        raise IndexError(f"{_GATHER}: token id out of range [0, {weight.n})")
    return dequantize(weight)[ids]


def quant_gather(weight: QuantWeight, ids: torch.Tensor, *, kernels=None) -> torch.Tensor:
    """Rows ``W[ids]``: the C form when ``kernels`` takes them, else :func:`quant_gather_ref`."""
    _check_gather(weight, ids)
    if kernels is not None and kernels.takes_quant_gather(weight, ids):
        return kernels.quant_gather(weight, ids)
    return quant_gather_ref(weight, ids)

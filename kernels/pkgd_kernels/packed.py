"""Matrix-vector products and row reads on a weight held in oneDNN's blocked packing.

On CPU the runner repacks each linear's weight ``W [N, K]`` once with
``torch.ops.mkldnn._reorder_linear_weight`` so oneDNN's GEMM reads it fast at batch sizes
the scheduler builds; decode (a few rows) then reads that same buffer rather than a second
copy. oneDNN's packings here, which the runner checks against oneDNN's own product before it
hands a view of the buffer to these ops:

* float32: ``[N/64, K, 64]``, element ``(n, k)`` at ``[n // 64, k, n % 64]``;
* bfloat16: ``[N/B, K/2, B, 2]``, element ``(n, k)`` at ``[n // B, k // 2, n % B, k % 2]``
  (pairs of K adjacent: the operand layout of AVX512-BF16's ``vdpbf16ps``), with oneDNN's block
  width B chosen per CPU (32 on the AMX hosts seen, 64 on an AVX512-BF16 one without AMX).

Ops:

* ``gemv_packed(x [M, K], weight, bias [N] | None) -> [M, N]``: ``x @ W^T + bias`` in ``x``'s
  dtype; with bf16 weights ``x`` is rounded to bf16 and the products summed in float32, as a
  bf16 GEMM does. Meant for small M (decode), where it is memory-bound.
* ``gather_packed(weight, ids [T]) -> [T, K]``: rows ``W[ids]`` in the weight's dtype, the
  lookup of an embedding tied to a packed LM head.

Both are CPU ops with a C form (`pkgd_kernels.cpu.CpuKernels`) and no Triton one: the
dispatchers run the C form when a loaded handle is passed as ``kernels`` and takes the
tensors, else the PyTorch reference.
"""

from __future__ import annotations

import torch

from pkgd_kernels._util import check_dtype, check_shape

_GEMV = "gemv_packed"
_GATHER = "gather_packed"


def _check_weight(op: str, weight: torch.Tensor) -> tuple[int, int]:
    """``(N, K)`` of a packed weight."""
    check_dtype(op, "weight", weight, [torch.float32, torch.bfloat16])
    if weight.dtype == torch.float32:
        check_shape(op, "weight", weight, [None, None, 64])
        return weight.shape[0] * 64, weight.shape[1]
    check_shape(op, "weight", weight, [None, None, None, 2])
    if weight.shape[2] not in (32, 64):
        raise ValueError(f"{op}: a bfloat16 weight is [N/B, K/2, B, 2] with B 32 or 64, got {tuple(weight.shape)}")
    return weight.shape[0] * weight.shape[2], weight.shape[1] * 2


def _check_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    n, k = _check_weight(_GEMV, weight)
    check_shape(_GEMV, "x", x, [None, k])
    check_dtype(_GEMV, "x", x, [torch.float32] if weight.dtype == torch.float32 else [torch.float32, torch.bfloat16])
    if bias is not None:
        check_shape(_GEMV, "bias", bias, [n])
    return n


def gemv_packed_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with ``W`` given in a packing (PyTorch reference).

    Args:
        x: ``[M, K]``, any strides; float32 (float32 weights), float32 or bfloat16 (bf16 ones).
        weight: float32 ``[N/64, K, 64]`` (``W[n, k] = weight[n // 64, k, n % 64]``) or
            bfloat16 ``[N/B, K/2, B, 2]``, B 32 or 64 (``W[n, k] = weight[n // B, k // 2, n % B, k % 2]``).
        bias: ``[N]`` or None.

    Returns:
        A new ``[M, N]`` in ``x``'s dtype. With bf16 weights ``x`` is rounded to bf16 first and
        the sums are float32 (rounded to ``x``'s dtype once).

    Raises:
        ValueError: shapes or dtypes that do not fit.
    """
    n = _check_gemv(x, weight, bias)
    if weight.dtype == torch.float32:
        y = torch.einsum("mk,bkc->mbc", x, weight).reshape(x.shape[0], n)
        return y + bias if bias is not None else y
    xb = x.to(torch.bfloat16).float().reshape(x.shape[0], -1, 2)
    y = torch.einsum("mjt,bjct->mbc", xb, weight.float()).reshape(x.shape[0], n)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def gemv_packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, kernels=None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` on the packed weight: the C form when ``kernels`` (a
    `pkgd_kernels.cpu.CpuKernels`) takes the tensors, else :func:`gemv_packed_ref` (shapes
    and errors there)."""
    _check_gemv(x, weight, bias)
    if kernels is not None and kernels.takes_gemv_packed(x, weight):
        return kernels.gemv_packed(x, weight, bias)
    return gemv_packed_ref(x, weight, bias)


def _check_gather(weight: torch.Tensor, ids: torch.Tensor) -> int:
    n, _ = _check_weight(_GATHER, weight)
    check_shape(_GATHER, "ids", ids, [None])
    check_dtype(_GATHER, "ids", ids, [torch.int64])
    return n


def gather_packed_ref(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``W[ids]`` of the matrix packed in ``weight`` (PyTorch reference).

    Args:
        weight: a packing as in :func:`gemv_packed_ref`.
        ids: int64 ``[T]`` in ``[0, N)``.

    Returns:
        A new ``[T, K]`` in the weight's dtype.

    Raises:
        ValueError: shapes or dtypes that do not fit.
        IndexError: an id outside ``[0, N)`` (nothing is read).
    """
    n = _check_gather(weight, ids)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise IndexError(f"{_GATHER}: token id out of range [0, {n})")
    if weight.dtype == torch.float32:
        return weight[ids // 64, :, ids % 64]
    bb = weight.shape[2]
    return weight[ids // bb, :, ids % bb].reshape(ids.shape[0], -1)


def gather_packed(weight: torch.Tensor, ids: torch.Tensor, *, kernels=None) -> torch.Tensor:
    """Rows ``W[ids]`` of the packed weight: the C form when ``kernels`` is given (it prefetches
    a row's lines together: one float per 64-byte line), else :func:`gather_packed_ref`."""
    _check_gather(weight, ids)
    if kernels is not None and weight.is_contiguous():
        return kernels.gather_packed(weight, ids)
    return gather_packed_ref(weight, ids)

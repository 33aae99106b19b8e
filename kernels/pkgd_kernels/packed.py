"""Matrix-vector products and row reads on a weight held in oneDNN's blocked packing.

On CPU the runner repacks each linear's weight ``W [N, K]`` once with
``torch.ops.mkldnn._reorder_linear_weight`` so oneDNN's GEMM reads it fast at batch sizes
the scheduler builds; decode (a few rows) then reads that same buffer rather than a second
copy. For float32 weights oneDNN's packing is ``[N/64][K][64]``: element ``(n, k)`` at
``[n // 64, k, n % 64]``. The runner checks that layout against oneDNN's own product before
it hands a ``[N/64, K, 64]`` view of the buffer to these ops.

* ``gemv_packed(x [M, K], weight [N/64, K, 64], bias [N] | None) -> [M, N]``: ``x @ W^T +
  bias``, float32; meant for small M (decode), where it is memory-bound.
* ``gather_packed(weight [N/64, K, 64], ids [T]) -> [T, K]``: rows ``W[ids]``, the lookup of
  an embedding tied to a packed LM head.

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
    check_shape(op, "weight", weight, [None, None, 64])
    check_dtype(op, "weight", weight, [torch.float32])
    return weight.shape[0] * 64, weight.shape[1]


def _check_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    n, k = _check_weight(_GEMV, weight)
    check_shape(_GEMV, "x", x, [None, k])
    check_dtype(_GEMV, "x", x, [torch.float32])
    if bias is not None:
        check_shape(_GEMV, "bias", bias, [n])
    return n


def gemv_packed_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with ``W`` given in the ``[N/64, K, 64]`` packing (PyTorch reference).

    Args:
        x: float32 ``[M, K]``, any strides.
        weight: float32 ``[N/64, K, 64]``: ``W[n, k] = weight[n // 64, k, n % 64]``.
        bias: ``[N]`` or None.

    Returns:
        A new float32 ``[M, N]``.

    Raises:
        ValueError: shapes or dtypes that do not fit.
    """
    n = _check_gemv(x, weight, bias)
    y = torch.einsum("mk,bkc->mbc", x, weight).reshape(x.shape[0], n)
    return y + bias if bias is not None else y


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
        weight: float32 ``[N/64, K, 64]`` (layout as in :func:`gemv_packed_ref`).
        ids: int64 ``[T]`` in ``[0, N)``.

    Returns:
        A new float32 ``[T, K]``.

    Raises:
        ValueError: shapes or dtypes that do not fit.
        IndexError: an id outside ``[0, N)`` (nothing is read).
    """
    n = _check_gather(weight, ids)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise IndexError(f"{_GATHER}: token id out of range [0, {n})")
    return weight[ids // 64, :, ids % 64]


def gather_packed(weight: torch.Tensor, ids: torch.Tensor, *, kernels=None) -> torch.Tensor:
    """Rows ``W[ids]`` of the packed weight: the C form when ``kernels`` is given (it prefetches
    a row's lines together: one float per 64-byte line), else :func:`gather_packed_ref`."""
    _check_gather(weight, ids)
    if kernels is not None and weight.is_contiguous():
        return kernels.gather_packed(weight, ids)
    return gather_packed_ref(weight, ids)

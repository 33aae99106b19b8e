"""ctypes bindings of ``quant.c``: the C forms of `pkgd_kernels.quant`'s ops on GGUF quantized
weights (`pkgd_kernels.quant_layout.QuantWeight`), built and loaded on first use through a
`pkgd_kernels.cpu.CpuKernels` handle (``CpuKernels.quant``) into the same kernel cache.

The library carries three paths over the same integer arithmetic, chosen at load by CPU feature
(`IMPLS`: AVX-512 VNNI ``vpdpbusd``, AVX2 ``vpmaddubsw``, portable C), each compiled for its own
target whatever ``-march`` the build used; `QuantKernels.use_impl` switches (tests run every
path the host has). A weight is handed to C as a ``pkgd_qweight`` (`QWeightStruct`): its
segments' types, row counts and addresses; the library reports that struct's layout and the
loader refuses it when it disagrees with the binding.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pkgd_kernels.cpu.build import LibrarySpec
from pkgd_kernels.quant_layout import BLOCK, MAX_SEGMENTS, QuantWeight

IMPLS = {"scalar": 0, "avx2": 1, "vnni512": 2}
"""Paths of the quantized kernels, slowest first."""

_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class QSegment(ctypes.Structure):
    """C ``pkgd_qsegment``: one segment's GGML type, rows (multiple of 16) and bytes."""

    _c_name_ = "pkgd_qsegment"
    _fields_ = [("qtype", _i64), ("rows", _i64), ("data", _p)]


class QWeightStruct(ctypes.Structure):
    """C ``pkgd_qweight``: ``n`` rows (all segments', padding included), ``k`` inputs, the segments."""

    _c_name_ = "pkgd_qweight"
    _fields_ = [("n", _i64), ("k", _i64), ("nseg", _i64), ("seg", QSegment * MAX_SEGMENTS)]


QUANT = LibrarySpec("cpu-quant", Path(__file__).with_name("quant.c"), abi_version=1, structs=(QSegment, QWeightStruct))
"""The library of ``quant.c``, checked against the two structs above at load."""


def descriptor(weight: QuantWeight) -> QWeightStruct:
    """The ``pkgd_qweight`` of ``weight`` (kept in ``weight.cache``; valid while it lives)."""
    desc = weight.cache.get("c")
    if desc is None:
        desc = QWeightStruct(n=weight.rows, k=weight.k, nseg=len(weight.segments))
        base = weight.data.data_ptr()
        for i, s in enumerate(weight.segments):
            desc.seg[i] = QSegment(qtype=s.qtype, rows=s.rows, data=base + s.offset)
        weight.cache["c"] = desc
    return desc


def takes_quant_linear(x: torch.Tensor, weight: QuantWeight) -> bool:
    """Whether the C form takes these: float32 ``x [M, K]`` on CPU with unit column stride,
    a contiguous weight."""
    return (
        isinstance(weight, QuantWeight) and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == weight.k
        and x.stride(1) == 1 and not x.is_cuda and weight.data.is_contiguous()
    )  # fmt: skip


class QuantKernels:
    """The loaded ``quant.c`` (see the module docstring): ``lib``, the `QUANT` library opened
    from the kernel cache ``cache_dir`` (`pkgd_kernels.cpu.CpuKernels.quant` builds and opens
    it). ``impl`` is the path in use."""

    def __init__(self, lib: ctypes.CDLL, cache_dir: Path) -> None:
        self.path = cache_dir
        self._linear = lib.pkgd_quant_linear
        self._linear.argtypes = [ctypes.POINTER(QWeightStruct), _p, _i64, _p, _p, _i64, _i32]
        self._linear.restype = _i32
        self._gather = lib.pkgd_quant_gather
        self._gather.argtypes = [ctypes.POINTER(QWeightStruct), _p, _i64, _p]
        self._gather.restype = _i32
        self._act = lib.pkgd_quant_activations
        self._act.argtypes = [_p, _p, _i64, _i64, _i64, _i32]
        self._act.restype = None
        lib.pkgd_quant_best_impl.restype = _i32
        best = lib.pkgd_quant_best_impl()
        self.best_impl = next(name for name, v in IMPLS.items() if v == best)
        self.impl = self.best_impl

    def available_impls(self) -> list[str]:
        """The paths this CPU runs, slowest first."""
        return [name for name, v in IMPLS.items() if v <= IMPLS[self.best_impl]]

    def use_impl(self, impl: str) -> None:
        """Run the kernels on path ``impl`` (one of `available_impls`).

        Raises:
            ValueError: an unknown path, or one this CPU lacks.
        """
        if impl not in self.available_impls():
            raise ValueError(
                f"quantized kernel path {impl!r} is not one this CPU runs: {', '.join(self.available_impls())}"
            )
        self.impl = impl

    def quant_linear(self, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """C form of `pkgd_kernels.quant_linear`: float32 ``x [M, K]`` -> new float32 ``[M, N]``.

        Raises:
            ValueError: tensors `takes_quant_linear` refuses, or a weight the library refuses.
            MemoryError: no memory for the quantized activations.
        """
        if not takes_quant_linear(x, weight):
            raise ValueError("quant_linear: x must be float32 [M, K] with unit column stride on CPU")
        m, rows = x.shape[0], weight.rows
        y = torch.empty(m, rows, dtype=torch.float32)
        b = None
        if bias is not None:
            b = torch.zeros(rows, dtype=torch.float32)
            b[: weight.n] = bias
        rc = self._linear(
            ctypes.byref(descriptor(weight)),
            x.data_ptr(),
            x.stride(0),
            None if b is None else b.data_ptr(),
            y.data_ptr(),
            m,
            IMPLS[self.impl],
        )
        if rc == -2:
            raise ValueError("quant_linear: the library refuses this weight's layout")
        if rc:
            raise MemoryError("quant_linear: out of memory for the quantized activations")
        return y if rows == weight.n else y[:, : weight.n]

    def quant_gather(self, weight: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
        """C form of `pkgd_kernels.quant_gather`: rows ``ids`` (int64 ``[T]``) as a new float32 ``[T, K]``.

        Raises:
            ValueError: ``ids`` not a 1-D int64 tensor.
            IndexError: an id outside ``[0, N)``.
        """
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError("quant_gather: ids must be a 1-D int64 tensor")
        ids = ids.contiguous()
        if ids.numel() and int(ids.max()) >= weight.n:
            raise IndexError(f"quant_gather: token id out of range [0, {weight.n})")
        out = torch.empty(ids.shape[0], weight.k, dtype=torch.float32)
        rc = self._gather(ctypes.byref(descriptor(weight)), ids.data_ptr(), ids.shape[0], out.data_ptr())
        if rc == -1:
            raise IndexError(f"quant_gather: token id out of range [0, {weight.n})")
        if rc:
            raise ValueError("quant_gather: the library refuses this weight's layout")
        return out

    def quantize_activations(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The C quantization of float32 ``x [M, K]`` as `pkgd_kernels.quant.quantize_activations`
        returns it: ``(q int8 [M, K], dx float32 [M, K / block])`` (``block`` 32 or 256)."""
        if block not in BLOCK.values() or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
            raise ValueError("quantize_activations: float32 x [M, K] with unit column stride, block 32 or 256")
        m, k = x.shape
        fam = 0 if block == 32 else 1
        per_row = k + 8 * (k // 32) if fam == 0 else k + 4 * (k // 256) + 4 * (k // 16)
        row_bytes = (per_row + 63) // 64 * 64
        buf = torch.empty(m, row_bytes, dtype=torch.uint8)
        self._act(buf.data_ptr(), x.data_ptr(), x.stride(0), m, k, fam)
        q = buf[:, :k].view(torch.int8)
        dx = buf[:, k : k + 4 * (k // block)].contiguous().view(torch.float32)
        return q, dx

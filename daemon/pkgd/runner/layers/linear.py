"""Tensor-parallel linear layers (Megatron-LM's column/row split, Shoeybi et al., 2019).

Layouts are chosen for the batch-1 (memory-bound) matrix-vector product, where MKL's speed
depends on the shape; for batches both layouts reach the same GEMM speed. Wide outputs (QKV,
gate/up, the LM head) stream faster as ``x @ W`` with ``W [in, out]`` than with ``F.linear`` on
``[out, in]``, while the narrow row-parallel outputs (down) stream faster with ``F.linear``
(fp32, one thread, weights far beyond the caches; ``benchmarks/model_step.py`` shows the step).
So column-parallel weights are stored ``[in, out]`` and row-parallel ones ``[out, in]``.

* `MergedColumnParallelLinear`: several projections of one input fused into one GEMM (QKV,
  gate/up). Each part is split by output rows across ranks; the local weight is the
  concatenation of every part's shard. ``load_part(i, w)`` takes the full HF weight
  ``[out_i, in]`` (or bias) of part i.
* `RowParallelLinear`: input features split across ranks, partial outputs summed with an
  all-reduce; the bias is added once, after the reduce.

On CPU, once the weights are loaded, `process_weights_after_loading` repacks a float32
weight into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the
packing PyTorch Inductor uses for CPU linears) and the forward calls
``torch.ops.mkldnn._linear_pointwise`` on it; the dense weight is dropped (the packed one is
~5% larger). Measured here (fp32, 2 threads, weights beyond the caches, GFLOP/s, MKL ``F.linear``
-> oneDNN packed): M=1 5-7 -> 10-12; M=64 126-141 -> 182-190; M=85 142-154 -> 190-200; at
M=2048 both ~190. Without oneDNN in the torch build the dense path stays.

Up to `GEMV_MAX_BATCH` rows (decode of a few sequences, memory-bound) the forward instead
calls ``pkgd_kernels.gemv_packed`` on the same packed buffer, through its C form (the layer's
``kernels``, a `pkgd_kernels.cpu.CpuKernels`, when the runner loaded them): oneDNN's layout
here is ``[out/64][in][64]``, which `packed_view` checks against oneDNN's own product once
per weight before exposing the buffer as a ``[out/64, in, 64]`` tensor.
Measured here (2 threads, weights beyond the caches, GB/s read, oneDNN -> C):
M=1 15-22 -> 23-29, M=4 17-25 -> 26-32, M=8 15-23 -> 20-25, M=16 about equal.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

import pkgd_kernels as pk
from pkgd.config.errors import ModelConfigMismatch
from pkgd.runner.distributed import SINGLE, TPGroup

ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
PACK_BATCH_HINT = 64  # the batch size oneDNN tunes the packing for (any batch works)
# oneDNN keeps one primitive (and its buffers, ~0.2-1 MB) per distinct (shape, batch size);
# its default 1024 entries let a long-running engine grow by hundreds of MB as batch sizes
# vary. Decode batch sizes change slowly and steps mixing prefill have a new size almost every
# time (no reuse to lose), so 32 (a few sizes for each of the ~5 weight shapes) keeps the hits:
# peak RSS of a 256 x (128 -> 128) run 1.56 -> 1.53 GB against 128 entries.
PRIMITIVE_CACHE_CAPACITY = "32"
GEMV_MAX_BATCH = 8  # rows up to which the C GEMV beats oneDNN (module docstring)


def onednn_packs_bf16() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU: it needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and torch raises for a bf16 reorder elsewhere (AVX2-only hosts)."""
    return ONEDNN_LINEAR and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight [out, in]`` float32 or bfloat16 on CPU (any strides) repacked for `onednn_linear`; None when
    oneDNN's packed linear is unavailable or does not apply (device, dtype, a bf16 weight where
    `onednn_packs_bf16` is False: it stays a plain tensor for ``F.linear``)."""
    if not ONEDNN_LINEAR or weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if weight.dtype == torch.bfloat16 and not onednn_packs_bf16():
        return None
    # Read by oneDNN when it creates its first primitive, which is after loading; an
    # operator's own setting wins.
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", PRIMITIVE_CACHE_CAPACITY)
    # A transposed view (the column-parallel layers' ``[in, out]`` storage) is passed as is:
    # oneDNN's reorder reads it through its strides, bit-equal to the packing of a contiguous
    # copy, without making that copy (half of a bf16 load's packing time).
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)


class GemvLayer(Protocol):
    """What `small_batch_gemv` reads of a layer."""

    @property
    def kernels(self) -> Any: ...  # the CPU kernels object, or None

    @property
    def gemv_weight(self) -> torch.Tensor | None: ...


def _repack(layer: MergedColumnParallelLinear | RowParallelLinear, weight_out_in: torch.Tensor) -> None:
    """Replace ``layer.weight`` by its oneDNN packing (given as ``[out, in]``) once."""
    packed = None if layer.packed else pack_for_onednn(weight_out_in)
    if packed is not None:
        layer.gemv_weight = packed_view(packed, *weight_out_in.shape)
        layer.weight = nn.Parameter(packed, requires_grad=False)
        layer.packed = True


def packed_view(packed: torch.Tensor, n: int, k: int) -> torch.Tensor | None:
    """``packed`` (from `pack_for_onednn`, of ``W [n, k]``) as the tensor
    ``pkgd_kernels.gemv_packed`` reads: float32 ``[n/64, k, 64]`` or bfloat16 ``[n/B, k/2, B, 2]``
    (B = 32 or 64: oneDNN's block width depends on the CPU), when oneDNN laid it out so (checked
    by comparing ``gemv_packed_ref`` on three blocks of the view with oneDNN's product on a
    random input, once per shape and dtype in a process; oneDNN picks other layouts for some
    shapes and CPUs); None otherwise. Valid while ``packed`` lives."""
    dtype = packed.dtype
    if dtype not in (torch.float32, torch.bfloat16) or torch.ops.mkldnn._nbytes(packed) != n * k * dtype.itemsize:
        return None
    if dtype == torch.float32:
        candidates: list[tuple[int, ...]] = [(n // 64, k, 64)] if n % 64 == 0 else []
        ctype: type[ctypes.c_float] | type[ctypes.c_uint16] = ctypes.c_float
    else:
        candidates = [(n // b, k // 2, b, 2) for b in (32, 64) if n % b == 0 and k % 2 == 0]
        ctype = ctypes.c_uint16
    if not candidates:
        return None
    buf = (ctype * (n * k)).from_address(torch.ops.mkldnn.data_ptr(packed))
    raw = torch.frombuffer(buf, dtype=torch.float32 if dtype == torch.float32 else torch.int16)
    flat = raw if dtype == torch.float32 else raw.view(torch.bfloat16)
    key = (n, k, dtype)
    if key in _LAYOUTS:
        found = _LAYOUTS[key]
        return flat.view(found) if found is not None else None
    found, decisive = _check_layouts(packed, flat, candidates, dtype, k)
    if decisive:
        _LAYOUTS[key] = found
    return flat.view(found) if found is not None else None


# (n, k, dtype) -> the view shape `packed_view` verified for oneDNN's packing of that shape, or
# None. oneDNN picks the packed layout from the shape, the dtype, the batch hint and the CPU
# alone, so one check per shape holds for every weight of it (a model has ~5 shapes and
# ~120 weights; checking each took ~0.2 s of every start). An all-zero weight decides nothing
# (every candidate computes its zeros) and is not remembered.
_LAYOUTS: dict[tuple[int, int, torch.dtype], tuple[int, ...] | None] = {}


def _check_layouts(
    packed: torch.Tensor, flat: torch.Tensor, candidates: list[tuple[int, ...]], dtype: torch.dtype, k: int
) -> tuple[tuple[int, ...] | None, bool]:
    """The first of ``candidates`` whose view of ``flat`` (the packed buffer) computes oneDNN's
    own product of ``packed`` on a random input, or None; and whether the product was nonzero
    (else the check tells the layouts apart nowhere)."""
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0)).to(dtype)
    ref = onednn_linear(x, packed, None).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: the two round their outputs apart
    for shape in candidates:
        view = flat.view(shape)
        # The first, a middle and the last block of outputs, each over every input: a layout
        # that differs anywhere (another block width, blocked inputs, blocks in another order)
        # already moves the first block's values; the reference on the whole weight took
        # seconds of each start (a float copy of every weight).
        b = shape[2] if dtype == torch.bfloat16 else 64
        blocks = sorted({0, shape[0] // 2, shape[0] - 1})
        cols = torch.cat([torch.arange(i * b, (i + 1) * b) for i in blocks])
        got = pk.gemv_packed_ref(x, view[blocks], None).float()
        want = ref[:, cols]
        if (got - want).abs().max() <= tol * want.abs().max() + 1e-6:
            return shape, bool(want.abs().max() > 0)
    return None, True


def small_batch_gemv(layer: GemvLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ W^T (+ bias)`` through the C form of ``pkgd_kernels.gemv_packed`` when the layer
    has the kernels and a packed view, ``x`` has at most `GEMV_MAX_BATCH` rows and the kernel
    takes it; None otherwise (the caller uses oneDNN's GEMM, faster than the op's reference)."""
    kernels, w = layer.kernels, layer.gemv_weight
    if kernels is None or w is None or x.shape[0] > GEMV_MAX_BATCH or not kernels.takes_gemv_packed(x, w):
        return None
    return pk.gemv_packed(x, w, bias, kernels=kernels)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [T, in] @ W^T (+ bias) -> [T, out]`` with a weight from `pack_for_onednn`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class MergedColumnParallelLinear(nn.Module):
    """``y = x @ [W_0 | W_1 | ...] (+ b)`` with each part sharded by output rows.

    Args:
        in_features: input size H.
        part_sizes: full (unsharded) output size of each fused part.
        part_shards: how many equal shards each part has: the TP size normally; for K/V heads
            fewer than ranks, the number of KV heads (each rank then holds a replica, vLLM's rule).
        bias: whether the parts have biases.
        kernels: the model's `pkgd_kernels.cpu.CpuKernels` (or None) for the small-batch GEMV.

    Input ``[T, H]`` in the model dtype; output ``[T, sum(local part sizes)]``.
    """

    def __init__(
        self,
        in_features: int,
        part_sizes: list[int],
        *,
        bias: bool,
        tp: TPGroup = SINGLE,
        part_shards: list[int] | None = None,
        dtype: torch.dtype = torch.float32,
        kernels=None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.kernels = kernels
        shards = part_shards or [tp.size] * len(part_sizes)
        self.part_sizes = list(part_sizes)
        self.shard_counts = shards
        self.local_sizes = [tp_shard(size, n, "output features") for size, n in zip(part_sizes, shards)]
        self.offsets = [sum(self.local_sizes[:i]) for i in range(len(part_sizes))]
        out = sum(self.local_sizes)
        self.in_features, self.out_features = in_features, out
        self.weight = nn.Parameter(torch.empty(in_features, out, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False) if bias else None
        self.packed = False
        self.gemv_weight: torch.Tensor | None = None  # [out/64, in, 64] over the packed buffer
        self.lora: Any = None  # `pkgd.runner.lora.layers.LinearSlots` when adapters are served

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base(x)
        return y if self.lora is None else self.lora.apply(x, y)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            y = small_batch_gemv(self, x, self.bias)
            return y if y is not None else onednn_linear(x, self.weight, self.bias)
        if self.bias is not None:
            return torch.addmm(self.bias, x, self.weight)
        return x @ self.weight

    def process_weights_after_loading(self) -> None:
        """Repack the loaded weight for oneDNN on CPU (module docstring); no-op elsewhere."""
        _repack(self, self.weight.t())

    def load_part(self, index: int, tensor: torch.Tensor, kind: str = "weight") -> None:
        """Copy this rank's rows of part ``index``'s full HF ``weight [out_i, in]`` or
        ``bias [out_i]`` (``kind``)."""
        rows = self._rows(index, tensor.shape[0])
        cols = slice(self.offsets[index], self.offsets[index] + self.local_sizes[index])
        if kind == "bias":
            if self.bias is None:
                raise ValueError("checkpoint has a bias for a layer built without one")
            _check_shape(tensor[rows], self.bias[cols], f"part {index} bias")
            self.bias[cols].copy_(tensor[rows])
            return
        _check_shape(tensor[rows].t(), self.weight[:, cols], f"part {index} weight")
        self.weight[:, cols].copy_(tensor[rows].t())

    def _rows(self, index: int, full: int) -> slice:
        if full != self.part_sizes[index]:
            raise ValueError(f"part {index} has {full} output rows, expected {self.part_sizes[index]}")
        n = self.shard_counts[index]
        shard = (self.tp.rank * n // self.tp.size) if n < self.tp.size else self.tp.rank
        size = self.local_sizes[index]
        return slice(shard * size, (shard + 1) * size)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T) (+ b)``; input ``[T, in/tp]``, output ``[T, out]``.
    ``weight`` is ``[out, in/tp]`` (see the module docstring for why)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        tp: TPGroup = SINGLE,
        dtype: torch.dtype = torch.float32,
        kernels=None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.kernels = kernels
        self.in_local = tp.shard(in_features, "input features")
        self.in_features, self.out_features = self.in_local, out_features
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed = False
        self.gemv_weight: torch.Tensor | None = None
        self.lora: Any = None  # `pkgd.runner.lora.layers.LinearSlots` when adapters are served

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            y = small_batch_gemv(self, x, None)
            y = y if y is not None else onednn_linear(x, self.weight, None)
        else:
            y = F.linear(x, self.weight)
        if self.lora is not None:  # this rank's share of the update, summed by the all-reduce
            y = self.lora.apply(x, y)
        y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y

    def process_weights_after_loading(self) -> None:
        """Repack the loaded weight for oneDNN on CPU (module docstring); no-op elsewhere."""
        _repack(self, self.weight)

    def load(self, tensor: torch.Tensor, kind: str = "weight") -> None:
        """Copy this rank's input columns of the full HF ``weight [out, in]``, or the whole
        ``bias [out]`` (``kind``)."""
        if kind == "bias":
            if self.bias is None:
                raise ValueError("checkpoint has a bias for a layer built without one")
            _check_shape(tensor, self.bias, "bias")
            self.bias.copy_(tensor)
            return
        cols = slice(self.tp.rank * self.in_local, (self.tp.rank + 1) * self.in_local)
        _check_shape(tensor[:, cols], self.weight, "weight")
        self.weight.copy_(tensor[:, cols])


def tp_shard(total: int, shards: int, what: str) -> int:
    """Size of one of ``shards`` equal parts of ``total``; `ModelConfigMismatch` when it does not divide."""
    if total % shards:
        raise ModelConfigMismatch(
            f"parallel.tp: {what} ({total}) is not divisible into {shards} tensor-parallel shards; "
            "choose a tensor-parallel size that divides it"
        )
    return total // shards


def _check_shape(src: torch.Tensor, dst: torch.Tensor, what: str) -> None:
    if src.shape != dst.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not match the model's {tuple(dst.shape)}")

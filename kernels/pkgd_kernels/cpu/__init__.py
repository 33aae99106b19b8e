"""CPU kernels written in C (``kernels.c``, loops in ``kernels.h``), compiled by the host's C
compiler on first use (`pkgd_kernels.cpu.build`), and the handle that holds them.

`load` returns a `CpuKernels`: the loaded library, handed explicitly to whoever runs ops (the
model runner builds one and passes it down to its model; nothing keeps it in a global). Each
method is the C form of the ``pkgd_kernels`` op of the same name, with the op's signature, and
each ``takes_<op>`` says whether the C form accepts given tensors; the op's dispatcher
(``pkgd_kernels.<op>(..., kernels=handle)``) checks that and otherwise runs the op's CPU
PyTorch form, which computes the same thing:

* `CpuKernels.gemv_packed`: ``x [M, K] @ W^T`` for small M straight from oneDNN's packed
  weight (fp32 ``[N/64][K][64]``, or bf16 ``[N/B][K/2][B][2]`` with oneDNN's block width B of 32
  or 64, `BF16_BLOCKS`), at DRAM read speed where MKL/oneDNN GEMV reach about half of it. bf16 products go through
  AVX512-BF16's ``vdpbf16ps`` where the CPU has it, else by widening each bf16 to float32
  (`CpuKernels.bf16_impl`, chosen at load; both give the same sums up to their order);
* `CpuKernels.gather_packed`: rows of such a packed weight (a tied embedding's lookup);
* `CpuKernels.paged_attention_decode`: one query token per sequence over the paged KV cache,
  read in place through the block table instead of gathering K/V copies (bf16 queries over a
  bf16 cache: scores by `CpuKernels.bf16_impl` too);
* `CpuKernels.rms_norm` / `CpuKernels.fused_add_rms_norm`: RMSNorm (with the residual add
  fused), one pass over each float32 or bf16 row (at batch 1 PyTorch's composite op cost ~25 us
  a call; on bf16 it also converts each way), bf16 with the reference's roundings;
* `CpuKernels.rotary_embedding`: RoPE on float32 or bf16 query/key rows, reading the table by
  position (no gathered copy, no float32 copy of bf16 rows);
* `CpuKernels.silu_and_mul`: SwiGLU's gate on float32 or bf16 rows, one pass (PyTorch runs
  two ops, each converting bf16 to float32 and back);
* `CpuKernels.quant_linear` / `CpuKernels.quant_gather`: linears and lookups on GGUF
  quantized weights, from a library of their own (``quant.c``, `CpuKernels.quant`, built on
  first use; `pkgd_kernels.cpu.quant`).

A model family can build a fused step of its own on the same loops (`CpuKernels.load_library`
with a `build.LibrarySpec` whose source includes ``kernels.h``), e.g. Llama's one-call decode
step in ``pkgd/runner/models/llama_cpu_decode.c``.

The library links libgomp, which torch already loaded (same soname), so both share one
OpenMP thread pool and ``torch.set_num_threads`` sizes both.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pkgd_kernels.cpu.build import (
    CpuKernelsUnavailable,
    LibrarySpec,
    check_enabled,
    default_cache_dir,
    open_library,
)

SOURCE = Path(__file__).with_name("kernels.c")
KERNELS = LibrarySpec("cpu-kernels", SOURCE, abi_version=10)
"""The generic library (``kernels.c``): exports only pointers and scalars, so no structs."""

_CACHE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
BF16_IMPLS = {"widen": 0, "dpbf16": 1}
ROPE_MAX_ROT = 512  # the rotated channels per head pkgd_rotary_embedding's per-token buffers hold
BF16_BLOCKS = ((32, 2), (64, 2))
"""The trailing dims of the bf16 packings the C GEMV reads: oneDNN's ``[N/B, K/2, B, 2]`` with
B chosen by oneDNN per CPU (32 on the AMX hosts seen, 64 on an AVX512-BF16 one without AMX)."""
"""The bf16 dot products of the C GEMVs: widening to float32 (any CPU), ``vdpbf16ps`` (AVX512-BF16)."""

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float

__all__ = ["KERNELS", "CpuKernels", "CpuKernelsUnavailable", "default_cache_dir", "load"]


class CpuKernels:
    """ctypes bindings of ``kernels.c`` (see the module docstring); ``cache_dir`` is where it
    and any library `load_library` builds live."""

    def __init__(self, lib: ctypes.CDLL, path: Path, cache_dir: Path) -> None:
        self.path = path
        self.cache_dir = cache_dir
        self._lib = lib
        lib.pkgd_bf16_dot_native.restype = ctypes.c_int
        self.bf16_native = bool(lib.pkgd_bf16_dot_native())
        self.bf16_impl = "dpbf16" if self.bf16_native else "widen"
        """How bf16 GEMVs multiply: ``dpbf16`` where the CPU has AVX512-BF16, else ``widen``;
        `use_bf16_impl` switches (tests run both)."""
        self._gemv_bf16 = lib.pkgd_gemv_bf16_packed
        self._gemv_bf16.argtypes = [_p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _i32]
        self._gemv_bf16.restype = ctypes.c_int
        self._gather_bf16 = lib.pkgd_gather_bf16_packed
        self._gather_bf16.argtypes = [_p, _p, _p, _i64, _i64, _i64, _i64]
        self._gather_bf16.restype = ctypes.c_int
        self._gemv = lib.pkgd_gemv_packed64
        self._gemv.argtypes = [_p, _i64, _p, _p, _p, _i64, _i64, _i64]
        self._gemv.restype = None
        self._attn = lib.pkgd_paged_attention_decode
        self._attn.argtypes = [_p, _p, _i64, _i32, _p, _p, _i32, _p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _f32, _i32]
        self._attn.restype = ctypes.c_int
        lib.pkgd_num_threads.restype = ctypes.c_int
        self._rms = lib.pkgd_rms_norm
        self._rms.argtypes = [_p, _p, _p, _i64, _p, _p, _i64, _i64, _f32]
        self._rms.restype = None
        self._rms_bf16 = lib.pkgd_rms_norm_bf16
        self._rms_bf16.argtypes = [_p, _p, _p, _i64, _p, _p, _i64, _i64, _f32]
        self._rms_bf16.restype = None
        self._silu_mul = lib.pkgd_silu_and_mul
        self._silu_mul.argtypes = [_p, _p, _i64, _i64, _i64, _i32]
        self._silu_mul.restype = ctypes.c_int
        self._rope = lib.pkgd_rotary_embedding
        self._rope.argtypes = [_p, _p, _p, _i64, _p, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _i32, _i32]
        self._rope.restype = _i64
        self._gather = lib.pkgd_gather_packed64
        self._gather.argtypes = [_p, _p, _p, _i64, _i64, _i64]
        self._gather.restype = ctypes.c_int

    def num_threads(self) -> int:
        """OpenMP threads a kernel call uses (follows ``torch.set_num_threads``)."""
        return self._lib.pkgd_num_threads()

    def use_bf16_impl(self, impl: str) -> None:
        """Make bf16 GEMVs, and the scores of bf16 decode attention over a bf16 cache, use
        ``impl`` (`BF16_IMPLS`).

        Raises:
            ValueError: an unknown name, or ``dpbf16`` on a CPU without AVX512-BF16.
        """
        if impl not in BF16_IMPLS or (impl == "dpbf16" and not self.bf16_native):
            raise ValueError(
                f"bf16 impl {impl!r} is not available here (have: {'dpbf16, ' if self.bf16_native else ''}widen)"
            )
        self.bf16_impl = impl

    def load_library(self, spec: LibrarySpec) -> ctypes.CDLL:
        """Build (once) and load another library on these kernels' loops into the same cache.

        Raises:
            CpuKernelsUnavailable: as `load`, or the library disagrees with ``spec``.
        """
        return open_library(spec, self.cache_dir)[0]

    @functools.cached_property
    def quant(self):
        """The quantized-weight kernels (`pkgd_kernels.cpu.quant.QuantKernels`), built and loaded
        on first use.

        Raises:
            CpuKernelsUnavailable: that library cannot be built or loaded.
        """
        from pkgd_kernels.cpu.quant import QUANT, QuantKernels

        return QuantKernels(self.load_library(QUANT), self.cache_dir)

    def quant_linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
        """C form of `pkgd_kernels.quant_linear` (`pkgd_kernels.cpu.quant.QuantKernels.quant_linear`)."""
        return self.quant.quant_linear(x, weight, bias)

    def quant_gather(self, weight, ids: torch.Tensor) -> torch.Tensor:
        """C form of `pkgd_kernels.quant_gather` (`pkgd_kernels.cpu.quant.QuantKernels.quant_gather`)."""
        return self.quant.quant_gather(weight, ids)

    @staticmethod
    def takes_quant_linear(x: torch.Tensor, weight) -> bool:
        """Whether `quant_linear` takes these (`pkgd_kernels.cpu.quant.takes_quant_linear`)."""
        from pkgd_kernels.cpu.quant import takes_quant_linear

        return takes_quant_linear(x, weight)

    @staticmethod
    def takes_quant_gather(weight, ids: torch.Tensor) -> bool:
        """Whether `quant_gather` takes these: a contiguous quantized weight, 1-D int64 ``ids`` on CPU."""
        from pkgd_kernels.quant_layout import QuantWeight

        return (
            isinstance(weight, QuantWeight)
            and weight.data.is_contiguous()
            and ids.dtype == torch.int64
            and ids.dim() == 1
            and not ids.is_cuda
        )

    # ---- which tensors each C form takes ----------------------------------------------------

    @staticmethod
    def takes_gemv_packed(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `gemv_packed` takes these: ``x [M, K]`` with unit column stride and a
        contiguous packed weight, float32 ``[N/64, K, 64]`` (float32 ``x``) or bfloat16
        ``[N/B, K/2, B, 2]``, B 32 or 64 (float32 or bfloat16 ``x``)."""
        if x.dim() != 2 or x.stride(1) != 1 or x.is_cuda or not weight.is_contiguous():
            return False
        if weight.dtype == torch.float32:
            return (
                x.dtype == torch.float32
                and weight.dim() == 3
                and weight.shape[2] == 64
                and x.shape[1] == weight.shape[1]
            )
        return (
            weight.dtype == torch.bfloat16 and x.dtype in (torch.float32, torch.bfloat16) and weight.dim() == 4
            and weight.shape[2:] in BF16_BLOCKS and x.shape[1] == 2 * weight.shape[1]
        )  # fmt: skip

    @staticmethod
    def takes_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `rms_norm` / `fused_add_rms_norm` take these: float32 or bfloat16 ``x [T, H]``
        with unit column stride, ``weight`` of the same dtype."""
        return (
            x.dtype in (torch.float32, torch.bfloat16)
            and weight.dtype == x.dtype
            and x.dim() == 2
            and x.stride(1) == 1
            and not x.is_cuda
        )

    @staticmethod
    def takes_rotary_embedding(query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor) -> bool:
        """Whether `rotary_embedding` takes these: float32 or bfloat16 ``query`` / ``key`` (one
        dtype) ``[T, heads * D]`` with unit column stride on CPU, a float32 contiguous table of at
        most `ROPE_MAX_ROT` columns."""
        return (
            query.dtype in (torch.float32, torch.bfloat16)
            and key.dtype == query.dtype
            and query.dim() == 2
            and key.dim() == 2
            and query.stride(1) == 1
            and key.stride(1) == 1
            and not query.is_cuda
            and cos_sin_cache.dtype == torch.float32
            and cos_sin_cache.is_contiguous()
            and cos_sin_cache.dim() == 2
            and cos_sin_cache.shape[1] <= ROPE_MAX_ROT
        )

    @staticmethod
    def takes_silu_and_mul(x: torch.Tensor) -> bool:
        """Whether `silu_and_mul` takes ``x``: float32 or bfloat16 ``[T, 2*I]`` on CPU with unit
        column stride."""
        return (
            x.dtype in (torch.float32, torch.bfloat16)
            and x.dim() == 2
            and x.shape[1] % 2 == 0
            and x.stride(1) == 1
            and not x.is_cuda
        )

    @staticmethod
    def takes_paged_attention_decode(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
        """Whether `paged_attention_decode` takes these: float32/bfloat16/float16 queries with
        contiguous heads, a contiguous float32/float16/bfloat16 cache, ``head_dim % 16 == 0``, at
        most 256 query heads, a whole number of them per KV head."""
        hq, d = query.shape[1], query.shape[2]
        hkv = key_cache.shape[2]
        return (
            query.dtype in _CACHE_DTYPES and key_cache.dtype in _CACHE_DTYPES and query.stride(2) == 1
            and query.stride(1) == d and d % 16 == 0 and hq % hkv == 0 and hq <= 256
            and key_cache.is_contiguous() and not query.is_cuda
        )  # fmt: skip

    # ---- the C forms of the ops ---------------------------------------------------------------

    def gemv_packed(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """C form of `pkgd_kernels.gemv_packed`: ``x [M, K]`` times the packed ``weight``
        (float32 ``[N/64, K, 64]`` or bf16 ``[N/B, K/2, B, 2]``) plus ``bias [N]``; a new
        ``[M, N]`` in ``x``'s dtype (bf16: ``x`` rounded to bf16, float32 sums, by `bf16_impl`).

        Raises:
            ValueError: tensors `takes_gemv_packed` refuses.
            MemoryError: no memory for the bf16 copy of ``x``.
        """
        if not self.takes_gemv_packed(x, weight):
            raise ValueError(
                "gemv_packed: x [M, K] with unit column stride and a contiguous packed weight, "
                "float32 [N/64, K, 64] (float32 x) or bfloat16 [N/B, K/2, B, 2] (B 32 or 64)"
            )
        b = None if bias is None else bias.to(torch.float32).contiguous()
        bp = None if b is None else b.data_ptr()
        if weight.dtype == torch.float32:
            n, k = weight.shape[0] * 64, weight.shape[1]
            y = torch.empty(x.shape[0], n, dtype=torch.float32)
            self._gemv(x.data_ptr(), x.stride(0), weight.data_ptr(), bp, y.data_ptr(), x.shape[0], n, k)
            return y
        bb = weight.shape[2]
        n, k = weight.shape[0] * bb, weight.shape[1] * 2
        x32 = x if x.dtype == torch.float32 else x.float()
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        if self._gemv_bf16(
            x32.data_ptr(),
            x32.stride(0),
            weight.data_ptr(),
            bp,
            y.data_ptr(),
            x.shape[0],
            n,
            k,
            bb,
            BF16_IMPLS[self.bf16_impl],
        ):
            raise MemoryError("gemv_packed: out of memory for the bf16 copy of x")
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def gather_packed(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """C form of `pkgd_kernels.gather_packed`: rows ``ids`` (int64 ``[T]``) of the matrix
        packed in the contiguous ``weight`` (float32 ``[N/64, K, 64]`` or bf16 ``[N/B, K/2, B,
        2]``); a new ``[T, K]`` in its dtype.

        Raises:
            ValueError: ``ids`` is not 1-D int64, or the weight not one of those packings.
            IndexError: an id outside ``[0, N)``.
        """
        f32 = weight.dtype == torch.float32 and weight.dim() == 3 and weight.shape[2] == 64
        bf16 = weight.dtype == torch.bfloat16 and weight.dim() == 4 and weight.shape[2:] in BF16_BLOCKS
        if ids.dtype != torch.int64 or ids.dim() != 1 or not (f32 or bf16) or not weight.is_contiguous():
            raise ValueError(
                "gather_packed: ids must be a 1-D int64 tensor, weight a contiguous float32 [N/64, K, 64] "
                "or bfloat16 [N/B, K/2, B, 2] (B 32 or 64)"
            )
        n, k = (
            (weight.shape[0] * 64, weight.shape[1]) if f32 else (weight.shape[0] * weight.shape[2], weight.shape[1] * 2)
        )
        ids = ids.contiguous()
        out = torch.empty(ids.shape[0], k, dtype=weight.dtype)
        args = (out.data_ptr(), weight.data_ptr(), ids.data_ptr(), ids.shape[0], n, k)
        if self._gather(*args) if f32 else self._gather_bf16(*args, weight.shape[2]):
            raise IndexError(f"gather_packed: token id out of range [0, {n})")
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """C form of `pkgd_kernels.rms_norm` (tensors `takes_rms_norm` accepts): a new
        contiguous ``[T, H]``.

        Raises:
            ValueError: tensors it does not take, or a weight that is not ``[H]``.
        """
        return self._rms_norm(x, None, weight, eps)[0]

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """C form of `pkgd_kernels.fused_add_rms_norm`: ``(rms_norm(x + residual), x +
        residual)``, new contiguous tensors.

        Raises:
            ValueError: as `rms_norm`, or a residual unlike ``x``.
        """
        out, res = self._rms_norm(x, residual, weight, eps)
        assert res is not None
        return out, res

    def _rms_norm(self, x, residual, weight, eps):
        h = x.shape[-1] if x.dim() == 2 else 0
        if (
            not self.takes_rms_norm(x, weight)
            or weight.shape != (h,)
            or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype))
        ):
            raise ValueError(
                "rms_norm: float32 or bfloat16 x [T, H] with unit column stride, weight [H] and residual like x"
            )
        t = x.shape[0]
        out = torch.empty(t, h, dtype=x.dtype)
        res_out = res_in = None
        if residual is not None:
            res_in = residual.contiguous()
            res_out = torch.empty(t, h, dtype=x.dtype)
        w = weight.contiguous()
        (self._rms if x.dtype == torch.float32 else self._rms_bf16)(
            out.data_ptr(),
            None if res_out is None else res_out.data_ptr(),
            x.data_ptr(),
            x.stride(0),
            None if res_in is None else res_in.data_ptr(),
            w.data_ptr(),
            t,
            h,
            eps,
        )
        return out, res_out

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        head_size: int,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """C form of `pkgd_kernels.rotary_embedding` (tensors `takes_rotary_embedding` accepts;
        the other arguments as the dispatcher checked them): new contiguous ``(query, key)``,
        rotated in float32 and rounded once, as the reference.

        Raises:
            ValueError: tensors it does not take, or a position outside the table.
        """
        if not self.takes_rotary_embedding(query, key, cos_sin_cache):
            raise ValueError(
                f"rotary_embedding: float32 or bfloat16 query/key [T, heads * D], a float32 table of at most "
                f"{ROPE_MAX_ROT} columns"
            )
        t, rot = query.shape[0], cos_sin_cache.shape[1]
        pos = positions.to(torch.int64).contiguous()
        q_out, k_out = torch.empty(query.shape, dtype=query.dtype), torch.empty(key.shape, dtype=key.dtype)
        bad = self._rope(
            q_out.data_ptr(), k_out.data_ptr(), query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0),
            pos.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], t, query.shape[1] // head_size,
            key.shape[1] // head_size, head_size, rot, int(is_neox), _CACHE_DTYPES[query.dtype],
        )  # fmt: skip
        if bad < 0:  # refused dtype or width, which takes_rotary_embedding already excludes
            raise ValueError("rotary_embedding: the C kernel refused these tensors")
        if bad:
            raise ValueError(
                f"rotary_embedding: positions must lie in [0, {cos_sin_cache.shape[0]}), got {pos[bad - 1].item()}"
            )
        return q_out, k_out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """C form of `pkgd_kernels.silu_and_mul` (tensors `takes_silu_and_mul` accepts): a new
        contiguous ``[T, I]`` in ``x``'s dtype; bf16 rounds silu's value before the product,
        as the reference's two bf16 ops do.

        Raises:
            ValueError: tensors it does not take.
        """
        if not self.takes_silu_and_mul(x):
            raise ValueError("silu_and_mul: float32 or bfloat16 x [T, 2*I] with unit column stride")
        t, n = x.shape[0], x.shape[1] // 2
        out = torch.empty(t, n, dtype=x.dtype)
        if t and n:
            self._silu_mul(out.data_ptr(), x.data_ptr(), x.stride(0), t, n, _CACHE_DTYPES[x.dtype])
        return out

    def paged_attention_decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int = 0,
        soft_cap: float = 0.0,
    ) -> torch.Tensor:
        """C form of `pkgd_kernels.paged_attention_decode`: ``query [S, Hq, D]`` (heads
        contiguous, any token stride), one token per sequence at position ``seq_lens[s] - 1``,
        over caches ``[num_blocks, block_size, Hkv, D]`` (float32, float16 or bfloat16;
        contiguous) through ``block_tables`` int32 ``[S, max_blocks]``; ``seq_lens`` int32
        ``[S]``. Computes in float32 (16-bit queries widened in the kernel; bf16 queries over a
        bf16 cache take their scores by `bf16_impl`, exact products in another order); returns a new
        ``[S, Hq, D]`` in the query dtype (16-bit: rounded once, to nearest even). It attends
        to every key: a ``sliding_window`` no sequence exceeds is accepted, a ``soft_cap`` is not.

        Raises:
            ValueError: a layout or dtype `takes_paged_attention_decode` refuses, a soft cap, or
                a sequence longer than the sliding window.
            MemoryError: the kernel could not allocate its per-thread scratch.
        """
        if not self.takes_paged_attention_decode(query, key_cache):
            raise ValueError("paged_attention_decode: unsupported layout or dtype")
        if soft_cap or (sliding_window and seq_lens.numel() and int(seq_lens.max()) > sliding_window):
            raise ValueError("paged_attention_decode: the C form has no soft cap or sliding window")
        s, hq, d = query.shape
        _, bs, hkv, _ = key_cache.shape
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        out = torch.empty(s, hq, d, dtype=query.dtype)
        rc = self._attn(
            out.data_ptr(), query.data_ptr(), query.stride(0), _CACHE_DTYPES[query.dtype], key_cache.data_ptr(),
            value_cache.data_ptr(), _CACHE_DTYPES[key_cache.dtype], tables.data_ptr(), tables.stride(0),
            lens.data_ptr(), s, hq, hkv, d, bs, scale, BF16_IMPLS[self.bf16_impl],
        )  # fmt: skip
        if rc:
            raise MemoryError("paged_attention_decode: out of memory for scratch buffers")
        return out


def load(cache_dir: Path | None = None) -> CpuKernels:
    """Build (once per host and source) and load the kernels from ``cache_dir`` (default
    `default_cache_dir`); the same directory gives a handle on the same library.

    Raises:
        CpuKernelsUnavailable: no C kernels for this CPU architecture, no compiler and nothing
            cached, the build failed, or the library disagrees with these bindings (the
            message says which).
    """
    check_enabled()
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    lib, path = open_library(KERNELS, cache_dir)
    return CpuKernels(lib, path, cache_dir)

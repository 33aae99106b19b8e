"""CPU kernels written in C (``kernels.c``), compiled by the host's C compiler on first use.

The hot loops of CPU decode that have no fast PyTorch op (DESIGN.md §5 "CPU specifics"), and a
whole decode step built from them:

* `CpuKernels.gemv_packed64`: ``x [M, K] @ W^T`` for small M straight from oneDNN's packed
  fp32 weight (layout ``[N/64][K][64]``), at DRAM read speed where MKL/oneDNN GEMV reach
  about half of it on this machine;
* `CpuKernels.paged_attention_decode`: one query token per sequence over the paged KV cache,
  read in place through the block table instead of gathering K/V copies;
* `CpuKernels.rms_norm`: RMSNorm with the residual add fused, one pass over each row (at
  batch 1 PyTorch's composite op cost ~25 us a call, 61 calls a token);
* `CpuKernels.decode_forward`: a whole decode step of a Llama-family model (every layer, up
  to 8 sequences) in one call and one OpenMP region, built from the loops above. At batch 1
  reading SmolLM2's weights takes ~10 ms a token here; the ~300 Python-level op calls of the
  per-layer forward added ~7 ms more.

Build: ``$CC`` (default ``gcc``; may carry arguments, e.g. ``ccache gcc``) with
``-O3 -march=native -fopenmp`` into ``<cache_dir>/cpu-kernels-<hash>.so``; the hash covers the
source, the flags and this CPU's feature flags, so a cache moved to another host is rebuilt
rather than crashing, and a cache filled in advance needs no compiler. Beside the library,
``<name>.so.sha256`` holds its digest, checked before loading (a truncated library can crash
the loader with SIGBUS); a cached library that fails the check or does not load is built
again once; builds of earlier sources are removed.
The file is written under a temporary name and renamed, so concurrent first starts (several
engine cores) never load a half-written library. `load` raises `CpuKernelsUnavailable` when
there is no compiler, the build fails, or ``PKGD_CPU_KERNELS=0``; callers then keep the
plain-PyTorch path, which computes the same thing.

The library links libgomp, which torch already loaded (same soname), so both share one
OpenMP thread pool and ``torch.set_num_threads`` sizes both.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
ABI_VERSION = 4
BUILD_TIMEOUT_S = 120
_CACHE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class CpuKernelsUnavailable(RuntimeError):
    """The C kernels cannot be used here; the message says why (no compiler, build error,
    disabled by ``PKGD_CPU_KERNELS=0``, not an x86-64/aarch64 CPU)."""


class DecoderLayerPointers(ctypes.Structure):
    """Addresses of one decoder layer's tensors for `CpuKernels.decode_forward` (C struct
    ``pkgd_decoder_layer``): linear weights in the ``[out/64][in][64]`` packing, Q/K rows and
    QK-norm weights in the adjacent-pair RoPE layout, float32 caches ``[num_blocks,
    block_size, Hkv, D]``; 0 (NULL) for a tensor the model does not have."""

    _fields_ = [(name, _p) for name in (
        "ln1", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "ln2",
        "gate_up", "gate_up_bias", "down", "down_bias", "k_cache", "v_cache",
    )]  # fmt: skip


class DecoderDims(ctypes.Structure):
    """Sizes of a Llama-family model for `CpuKernels.decode_forward` (C struct
    ``pkgd_decoder_dims``): counts in heads/features/tokens, ``scale`` the attention's
    ``1/sqrt(head_dim)``, ``cos_sin_cache`` float32 ``[max_position, rot_dim]`` (cos | sin)."""

    _fields_ = [
        *[(name, _i64) for name in (
            "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "rot_dim", "block_size",
        )],
        ("eps", _f32),
        ("scale", _f32),
        ("final_norm", _p),
        ("cos_sin_cache", _p),
    ]  # fmt: skip


class CpuKernels:
    """ctypes bindings of ``kernels.c``; each method checks the layouts it relies on."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._lib = lib
        self._gemv = lib.pkgd_gemv_packed64
        self._gemv.argtypes = [_p, _i64, _p, _p, _p, _i64, _i64, _i64]
        self._gemv.restype = None
        self._attn = lib.pkgd_paged_attention_decode
        self._attn.argtypes = [_p, _p, _i64, _p, _p, _i32, _p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _f32]
        self._attn.restype = ctypes.c_int
        lib.pkgd_num_threads.restype = ctypes.c_int
        self._rms = lib.pkgd_rms_norm
        self._rms.argtypes = [_p, _p, _p, _i64, _p, _p, _i64, _i64, _f32]
        self._rms.restype = None
        self._gather = lib.pkgd_gather_packed64
        self._gather.argtypes = [_p, _p, _p, _i64, _i64, _i64]
        self._gather.restype = ctypes.c_int
        self._decode = lib.pkgd_decode_forward
        self._decode.argtypes = [_p, _p, _p, _p, _i64, _p, _p, _p, _i64, _p]
        self._decode.restype = ctypes.c_int

    def num_threads(self) -> int:
        """OpenMP threads a kernel call uses (follows ``torch.set_num_threads``)."""
        return self._lib.pkgd_num_threads()

    def gemv_packed64(self, x: torch.Tensor, weight_ptr: int, bias: torch.Tensor | None, n: int, k: int) -> torch.Tensor:
        """``x [M, K]`` float32 (unit column stride) times the packed weight at ``weight_ptr``
        (``[N/64][K][64]`` float32, the oneDNN packing of ``W [N, K]``) plus ``bias [N]``.
        Returns a new ``[M, N]`` float32. N must be a multiple of 64."""
        if x.dtype != torch.float32 or x.stride(1) != 1 or x.shape[1] != k or n % 64:
            raise ValueError("gemv_packed64: x must be float32 [M, K] with unit column stride, N % 64 == 0")
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        b = None
        if bias is not None:
            b = bias.contiguous().data_ptr()
        self._gemv(x.data_ptr(), x.stride(0), weight_ptr, b, y.data_ptr(), x.shape[0], n, k)
        return y

    def gather_packed64(self, weight_ptr: int, ids: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """Rows ``ids`` (int64 ``[T]``) of ``W [N, K]`` float32 held packed at ``weight_ptr``
        (``[N/64][K][64]``, as `gemv_packed64` reads it): a new ``[T, K]`` float32.

        Raises:
            ValueError: ``ids`` is not a 1-D int64 tensor.
            IndexError: an id outside ``[0, N)``.
        """
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError("gather_packed64: ids must be a 1-D int64 tensor")
        ids = ids.contiguous()
        out = torch.empty(ids.shape[0], k, dtype=torch.float32)
        if self._gather(out.data_ptr(), weight_ptr, ids.data_ptr(), ids.shape[0], n, k):
            raise IndexError(f"token id out of range [0, {n})")
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """RMSNorm of ``x [T, H]`` float32 (unit column stride) scaled by ``weight [H]``;
        with ``residual [T, H]``, of ``x + residual``, which is returned too:
        ``(normed, x + residual or None)``, new contiguous tensors.

        Raises:
            ValueError: not float32, not 2-D with unit column stride, or shapes that differ.
        """
        t, h = x.shape if x.dim() == 2 else (0, 0)
        if (x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1 or weight.dtype != torch.float32
                or weight.shape != (h,) or (residual is not None and (residual.shape != x.shape or residual.dtype != torch.float32))):
            raise ValueError("rms_norm: float32 x [T, H] with unit column stride, weight [H], residual like x")
        out = torch.empty(t, h, dtype=torch.float32)
        res_out = res_in = None
        if residual is not None:
            res_in = residual.contiguous()
            res_out = torch.empty(t, h, dtype=torch.float32)
        w = weight.contiguous()
        self._rms(out.data_ptr(), None if res_out is None else res_out.data_ptr(), x.data_ptr(), x.stride(0),
                  None if res_in is None else res_in.data_ptr(), w.data_ptr(), t, h, eps)
        return out, res_out

    def decode_forward(
        self,
        dims: DecoderDims,
        layers: ctypes.Array,
        embeddings: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """One decode step of ``S`` sequences through every layer: ``embeddings [S, H]`` float32
        of the new tokens -> ``[S, H]`` float32 hidden states after the final RMSNorm. Writes each
        new token's K/V at ``slot_mapping`` (int64 ``[S]``, -1 = not written) in every layer's
        cache; attends over ``seq_lens`` (int32 ``[S]``, including the new token) through
        ``block_tables`` (int32 ``[S, max_blocks]``); RoPE at ``positions`` (int64 ``[S]``).

        ``dims`` and ``layers`` (``DecoderLayerPointers * num_layers``) must point at live
        tensors of the layouts they document; the caller keeps those alive.

        Raises:
            ValueError: a step tensor of the wrong dtype or shape.
            MemoryError: the kernel could not allocate its scratch.
        """
        s = embeddings.shape[0]
        if (embeddings.dtype != torch.float32 or embeddings.shape != (s, dims.hidden) or len(layers) != dims.num_layers
                or any(t.shape[0] != s for t in (positions, slot_mapping, block_tables, seq_lens))):
            raise ValueError("decode_forward: float32 embeddings [S, hidden] and one position/slot/table row/length per sequence")
        emb = embeddings.contiguous()
        pos = positions.to(torch.int64).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        out = torch.empty(s, dims.hidden, dtype=torch.float32)
        rc = self._decode(
            ctypes.byref(dims), layers, emb.data_ptr(), out.data_ptr(), s, pos.data_ptr(), slots.data_ptr(),
            tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        )  # fmt: skip
        if rc:
            raise MemoryError("decode_forward: out of memory for scratch buffers")
        return out

    def paged_attention_decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """``query [S, Hq, D]`` float32 (heads contiguous, any token stride), one token per
        sequence at position ``seq_lens[s] - 1``, over caches ``[num_blocks, block_size, Hkv,
        D]`` (float32, float16 or bfloat16; contiguous) through ``block_tables`` int32
        ``[S, max_blocks]``; ``seq_lens`` int32 ``[S]``. Returns ``[S, Hq, D]`` float32.

        Raises:
            ValueError: a layout or dtype the kernel does not take (`supports_decode` says
                beforehand).
            MemoryError: the kernel could not allocate its per-thread scratch.
        """
        if not supports_decode(query, key_cache):
            raise ValueError("paged_attention_decode: unsupported layout or dtype")
        s, hq, d = query.shape
        _, bs, hkv, _ = key_cache.shape
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        out = torch.empty(s, hq, d, dtype=torch.float32)
        rc = self._attn(
            out.data_ptr(), query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
            _CACHE_DTYPES[key_cache.dtype], tables.data_ptr(), tables.stride(0), lens.data_ptr(),
            s, hq, hkv, d, bs, scale,
        )  # fmt: skip
        if rc:
            raise MemoryError("paged_attention_decode: out of memory for scratch buffers")
        return out


def supports_decode(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether `CpuKernels.paged_attention_decode` takes these tensors."""
    hq, d = query.shape[1], query.shape[2]
    hkv = key_cache.shape[2]
    return (
        query.dtype == torch.float32
        and key_cache.dtype in _CACHE_DTYPES
        and query.stride(2) == 1
        and query.stride(1) == d
        and d % 16 == 0
        and hq % hkv == 0
        and hq <= 256
        and key_cache.is_contiguous()
    )


def default_cache_dir() -> Path:
    """``$PKGD_KERNEL_CACHE``, else ``$CACHE_DIRECTORY`` (systemd, first entry) ``/kernels``,
    else ``~/.cache/pkgd/kernels``."""
    if os.environ.get("PKGD_KERNEL_CACHE"):
        return Path(os.environ["PKGD_KERNEL_CACHE"])
    if os.environ.get("CACHE_DIRECTORY"):
        return Path(os.environ["CACHE_DIRECTORY"].split(":")[0]) / "kernels"
    return Path.home() / ".cache" / "pkgd" / "kernels"


def load(cache_dir: Path | None = None) -> CpuKernels:
    """Build (once per host and source) and load the kernels; later calls with the same
    directory return the same object. ``$PKGD_KERNEL_CACHE`` overrides ``cache_dir``, which
    defaults to `default_cache_dir`.

    Raises:
        CpuKernelsUnavailable: disabled (``PKGD_CPU_KERNELS=0``), no compiler and nothing
            cached, or the build failed (the message says which).
    """
    if os.environ.get("PKGD_CPU_KERNELS", "1").lower() in ("0", "false", "no", "off"):
        raise CpuKernelsUnavailable("disabled by PKGD_CPU_KERNELS=0")
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        raise CpuKernelsUnavailable(f"no C kernels for {platform.machine()}")
    if os.environ.get("PKGD_KERNEL_CACHE") or not cache_dir:
        cache_dir = default_cache_dir()
    return _load(Path(cache_dir))


@functools.cache
def _load(cache_dir: Path) -> CpuKernels:
    path = _build(cache_dir)
    try:
        lib = _open(path)
    except CpuKernelsUnavailable:
        path.unlink(missing_ok=True)  # a damaged cached library: build it again, once
        _digest_path(path).unlink(missing_ok=True)
        lib = _open(_build(cache_dir))
    return CpuKernels(lib, path)


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _open(path: Path) -> ctypes.CDLL:
    # dlopen of a cut-short library (an interrupted copy of a prefilled cache, a full disk)
    # can kill the process with SIGBUS instead of failing: check it against the digest
    # written beside it at build time first.
    try:
        intact = _digest_path(path).read_text().strip() == _digest(path)
    except OSError:
        intact = False
    if not intact:
        raise CpuKernelsUnavailable(f"{path} does not match {_digest_path(path).name} (damaged or incomplete)")
    try:
        lib = ctypes.CDLL(str(path))
        version = lib.pkgd_abi_version()
    except (OSError, AttributeError) as e:
        raise CpuKernelsUnavailable(f"cannot load {path}: {e}") from e
    if version != ABI_VERSION:
        raise CpuKernelsUnavailable(f"{path} has ABI {version}, expected {ABI_VERSION}")
    return lib


def library_path(cache_dir: Path) -> Path:
    """Where the library for this source, these flags and this CPU lives in ``cache_dir``
    (the compiler is not part of the key, so a cache filled in advance serves a host without
    one)."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS).encode(), _cpu_flags().encode()):
        key.update(part)
    return cache_dir / f"cpu-kernels-{key.hexdigest()[:16]}.so"


def _build(cache_dir: Path) -> Path:
    path = library_path(cache_dir)
    if path.exists():
        return path
    cc = shlex.split(os.environ.get("CC") or "gcc")  # e.g. CC="ccache gcc"
    if not cc or shutil.which(cc[0]) is None:
        raise CpuKernelsUnavailable(f"no C compiler ({os.environ.get('CC') or 'gcc'!r} not on PATH)")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".build-", suffix=".so")
        os.close(fd)
    except OSError as e:
        raise CpuKernelsUnavailable(f"cannot write to {cache_dir}: {e}") from e
    try:
        r = subprocess.run([*cc, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if r.returncode:
            raise CpuKernelsUnavailable(f"{' '.join(cc)} failed on {SOURCE.name}: {r.stderr.strip()[-500:]}")
        digest_tmp = Path(tmp + ".sha256")
        digest_tmp.write_text(_digest(Path(tmp)) + "\n")
        os.replace(digest_tmp, _digest_path(path))  # the digest first: a library is never without it
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as e:
        raise CpuKernelsUnavailable(f"building {SOURCE.name} failed: {e}") from e
    finally:
        for leftover in (tmp, tmp + ".sha256"):
            if os.path.exists(leftover):
                os.unlink(leftover)
    keep = {path.name, _digest_path(path).name}
    for old in cache_dir.glob("cpu-kernels-*"):  # builds of earlier sources (a loaded one stays mapped)
        if old.name not in keep:
            old.unlink(missing_ok=True)
    return path


def _cpu_flags() -> str:
    """This CPU's feature flags (what ``-march=native`` compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()

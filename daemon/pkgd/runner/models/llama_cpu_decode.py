"""The whole decode step of a Llama-family model in one C call on CPU.

At batch 1 a token reads ~540 MB of float32 weights, ~10 ms at this machine's DRAM speed, and
the layer-by-layer forward adds ~300 Python-level op calls (norms, RoPE, cache writes,
attention, SiLU, module calls), ~7 ms more. `CpuDecodeStep` hands the whole step to
``pkgd_decode_forward`` in ``llama_cpu_decode.c`` (built on the loops of ``pkgd_kernels.cpu``,
loaded through the model's `pkgd_kernels.cpu.CpuKernels`): every layer, in one OpenMP region,
on the same packed weights and KV cache the per-layer path uses, with the same arithmetic
except for the order of a few partial sums. Its reference is the model's per-layer forward
(`LlamaForCausalLM.forward_layers`); its tests compare the two.

The C structs ``pkgd_decoder_layer`` / ``pkgd_decoder_dims`` are mirrored by
`DecoderLayerPointers` / `DecoderDims`; the library reports their sizes and offsets and the
loader refuses it (the per-layer forward runs) when they disagree.

It serves a step when all of these hold, else the model's per-layer forward runs:

* every layer's MLP the dense SwiGLU one (an MoE model's routed experts are not in the C step:
  such a model runs its per-layer forward);
* CPU, float32 or bfloat16 model, no tensor parallelism, the C kernels loaded (bf16 weights:
  the GEMVs multiply by the handle's `pkgd_kernels.cpu.CpuKernels.bf16_impl`, the residual
  stream and everything between GEMVs stay float32);
* every linear's packed weight verified for the C GEMV (`layers.linear.packed_view`), or every
  linear quantized (`layers.quantized.QuantizedLinear`, GGUF blocks: the GEMVs are
  ``pkgd_kernels.quant_linear``'s, on the path of the handle's ``quant.impl``);
* ``head_dim % 16 == 0`` and at most 256 query heads;
* contiguous KV caches of one dtype (float32, float16 or bfloat16);
* every sequence of the step is a decode (one new token; a speculating request's verified
  positions count as consecutive one-token sequences of one block table, and then every K/V
  is written before any attention reads, ``AttentionMetadata.shares_sequences``) and there are at most
  `pkgd.runner.layers.linear.GEMV_MAX_BATCH` of them (beyond that the step is compute-bound
  and oneDNN's GEMM wins);
* the model is Llama-shaped (``one_call_decode`` true on its class: Gemma's norms, scaled
  embeddings and GeGLU are not), no layer soft-caps its attention logits, and no sequence
  of the step is longer than a layer's sliding window (the kernel attends to every key).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from pkgd import log
from pkgd.runner.attention import AttentionMetadata, KVCache
from pkgd.runner.layers.linear import GEMV_MAX_BATCH
from pkgd.runner.layers.quantized import QuantizedLinear
from pkgd_kernels.cpu import BF16_IMPLS, CpuKernels
from pkgd_kernels.cpu.build import CpuKernelsUnavailable, LibrarySpec
from pkgd_kernels.cpu.quant import IMPLS as QUANT_IMPLS
from pkgd_kernels.cpu.quant import QSegment, QWeightStruct, descriptor

# The model is a `pkgd.runner.models.llama.LlamaForCausalLM` (or a subclass); that module builds
# this step, so it is typed by what it is read for, not imported.
LlamaModel = Any

logger = log.get_logger("pkgd.runner")

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class DecoderLayerPointers(ctypes.Structure):
    """Addresses of one decoder layer's tensors (C struct ``pkgd_decoder_layer``): linear
    weights in oneDNN's packing of the dims' ``weight_dtype`` (float32 ``[out/64][in][64]``, bf16
    ``[out/B][in/2][B][2]`` with oneDNN's block width B of 32 or 64) or quantized (a
    ``pkgd_qweight`` each), float32 norms and biases, Q/K rows and QK-norm weights in the
    adjacent-pair RoPE layout, caches ``[num_blocks, block_size, Hkv, D]`` of the dims'
    ``kv_dtype``; 0 (NULL) for a tensor the model does not have."""

    _c_name_ = "pkgd_decoder_layer"
    _fields_ = [(name, _p) for name in (
        "ln1", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "ln2",
        "gate_up", "gate_up_bias", "down", "down_bias", "k_cache", "v_cache",
    )]  # fmt: skip


class DecoderDims(ctypes.Structure):
    """Sizes of a Llama-family model (C struct ``pkgd_decoder_dims``): counts in
    heads/features/tokens, ``scale`` the attention's ``1/sqrt(head_dim)``, ``weight_dtype`` (0
    float32, 1 bf16 in 32-wide blocks, 3 bf16 in 64-wide ones, 2 quantized), ``kv_dtype`` (0
    float32, 1 float16, 2 bf16), ``bf16_impl`` (0 widen, 1 vdpbf16ps), ``quant_impl`` (`pkgd_kernels.cpu.quant.IMPLS`),
    ``cos_sin_cache`` float32 ``[max_position, rot_dim]`` (cos | sin)."""

    _c_name_ = "pkgd_decoder_dims"
    _fields_ = [
        *[(name, _i64) for name in (
            "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "rot_dim", "block_size",
        )],
        ("eps", _f32),
        ("scale", _f32),
        *[(name, ctypes.c_int32) for name in ("weight_dtype", "kv_dtype", "bf16_impl", "quant_impl")],
        ("final_norm", _p),
        ("cos_sin_cache", _p),
    ]  # fmt: skip


LLAMA_DECODE = LibrarySpec(
    "llama-cpu-decode", Path(__file__).with_name("llama_cpu_decode.c"), abi_version=4,
    structs=(DecoderLayerPointers, DecoderDims, QSegment, QWeightStruct),
)  # fmt: skip
"""The library of ``llama_cpu_decode.c``, checked against the structs above at load (and the
quantized weight's, `pkgd_kernels.cpu.quant`)."""


class LlamaDecodeKernel:
    """ctypes binding of ``pkgd_decode_forward`` (loaded through a `CpuKernels` handle).

    Raises (from the constructor):
        CpuKernelsUnavailable: the library cannot be built or disagrees with the structs.
    """

    def __init__(self, kernels: CpuKernels) -> None:
        lib = kernels.load_library(LLAMA_DECODE)
        self._decode = lib.pkgd_decode_forward
        self._decode.argtypes = [_p, _p, _p, _p, _i64, _p, _p, _p, _i64, _p, _i64]
        self._decode.restype = ctypes.c_int

    def decode_forward(
        self,
        dims: DecoderDims,
        layers: ctypes.Array,
        embeddings: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        kv_first: bool = False,
    ) -> torch.Tensor:
        """One decode step of ``S`` sequences through every layer: ``embeddings [S, H]`` float32
        of the new tokens -> ``[S, H]`` float32 hidden states after the final RMSNorm. Writes each
        new token's K/V at ``slot_mapping`` (int64 ``[S]``, -1 = not written) in every layer's
        cache; attends over ``seq_lens`` (int32 ``[S]``, including the new token) through
        ``block_tables`` (int32 ``[S, max_blocks]``); RoPE at ``positions`` (int64 ``[S]``).
        ``kv_first``: write every row's K/V before any row attends, for rows that are
        consecutive positions of one sequence (speculative verification).

        ``dims`` and ``layers`` (``DecoderLayerPointers * num_layers``) must point at live
        tensors of the layouts they document; the caller keeps those alive.

        Raises:
            ValueError: a step tensor of the wrong dtype or shape.
            MemoryError: the kernel could not allocate its scratch.
        """
        s = embeddings.shape[0]
        if (
            embeddings.dtype != torch.float32
            or embeddings.shape != (s, dims.hidden)
            or len(layers) != dims.num_layers
            or any(t.shape[0] != s for t in (positions, slot_mapping, block_tables, seq_lens))
        ):
            raise ValueError(
                "decode_forward: float32 embeddings [S, hidden] and one position/slot/table row/length per sequence"
            )
        emb = embeddings.contiguous()
        pos = positions.to(torch.int64).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        out = torch.empty(s, dims.hidden, dtype=torch.float32)
        rc = self._decode(
            ctypes.byref(dims), layers, emb.data_ptr(), out.data_ptr(), s, pos.data_ptr(), slots.data_ptr(),
            tables.data_ptr(), tables.stride(0), lens.data_ptr(), int(kv_first),
        )  # fmt: skip
        if rc:
            raise MemoryError("decode_forward: out of memory for scratch buffers")
        return out


_WEIGHT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
W_QUANT = 2
W_BF16_64 = 3  # bf16 in oneDNN's 64-wide blocks ([out/64, in/2, 64, 2]; W_BF16 is 32-wide)


def _weight_dtype(model: LlamaModel, linears: list) -> int | None:
    """The kernel's weight_dtype for the float ``linears`` of ``model``: by dtype, and for bf16
    by the block width oneDNN packed them in (one for every linear, else None)."""
    if model.dtype != torch.bfloat16:
        return _WEIGHT_DTYPES[model.dtype]
    widths = {m.gemv_weight.shape[2] for m in linears}
    if len(widths) != 1:
        return None
    return {32: _WEIGHT_DTYPES[torch.bfloat16], 64: W_BF16_64}.get(widths.pop())


_KV_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _quant_ptr(linear: QuantizedLinear) -> int:
    """Address of a quantized linear's ``pkgd_qweight`` (kept alive by its weight)."""
    return ctypes.addressof(descriptor(linear.packed))


class CpuDecodeStep:
    """Pointers to one loaded model's tensors, laid out for `LlamaDecodeKernel.decode_forward`.

    Build with `CpuDecodeStep.build`; call it with a step's embeddings, positions, KV caches
    and metadata. It holds no tensors of its own: the model's parameters (and the runner's
    caches, re-read when they change) must outlive it, which they do as the model owns it.
    """

    def __init__(self, model: LlamaModel, kernels: CpuKernels, kernel: LlamaDecodeKernel, weight_dtype: int) -> None:
        cfg = model.cfg
        first = model.layers[0].self_attn
        self.kernels = kernels
        self.kernel = kernel
        self.dtype = model.dtype
        self.quantized = isinstance(first.qkv_proj, QuantizedLinear)
        self._f32: list[torch.Tensor] = []  # float32 copies of a 16-bit model's norms and biases
        _ptr = self._f32_ptr
        _w = _quant_ptr if self.quantized else (lambda m: m.gemv_weight.data_ptr())
        self.dims = DecoderDims(
            num_layers=len(model.layers),
            hidden=cfg.hidden_size,
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            intermediate=cfg.intermediate_size,
            rot_dim=model.rotary_emb.rot_dim,
            block_size=0,
            eps=cfg.rms_norm_eps,
            scale=first.scale,
            weight_dtype=weight_dtype,
            final_norm=_ptr(model.norm.weight),
            cos_sin_cache=_ptr(model.rotary_emb.cos_sin_cache),
        )
        self.layers = (DecoderLayerPointers * len(model.layers))()
        for ptrs, layer in zip(self.layers, model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            ptrs.ln1 = _ptr(layer.input_layernorm.weight)
            ptrs.qkv, ptrs.qkv_bias = _w(attn.qkv_proj), _ptr(attn.qkv_proj.bias)
            if attn.qk_norm:
                ptrs.q_norm, ptrs.k_norm = _ptr(attn.q_norm.weight), _ptr(attn.k_norm.weight)
            ptrs.o, ptrs.o_bias = _w(attn.o_proj), _ptr(attn.o_proj.bias)
            ptrs.ln2 = _ptr(layer.post_attention_layernorm.weight)
            ptrs.gate_up, ptrs.gate_up_bias = _w(mlp.gate_up_proj), _ptr(mlp.gate_up_proj.bias)
            ptrs.down, ptrs.down_bias = _w(mlp.down_proj), _ptr(mlp.down_proj.bias)
        self._caches_key: tuple[int, ...] | None = None
        windows = [layer.self_attn.sliding_window for layer in model.layers if layer.self_attn.sliding_window]
        self.max_seq_len = min(windows, default=None)  # beyond it a window would cut keys

    def _f32_ptr(self, t: torch.Tensor | None) -> int | None:
        """Address of ``t`` as float32 (a copy this step keeps for a 16-bit tensor), or None."""
        if t is None:
            return None
        if t.dtype != torch.float32 or not t.is_contiguous():
            t = t.float().contiguous()
            self._f32.append(t)
        return t.data_ptr()

    @classmethod
    def build(cls, model: LlamaModel) -> CpuDecodeStep | None:
        """The step for ``model``, or None when it does not qualify (module docstring; a
        library that cannot be built or loaded is logged as ``one_call_decode_unavailable``)."""
        kernels = model.kernels
        if kernels is None or model.dtype not in _WEIGHT_DTYPES or model.tp.size != 1 or model.norm.weight.is_cuda:
            return None
        if not model.one_call_decode or any(layer.self_attn.soft_cap for layer in model.layers):
            return None
        if any(getattr(layer.mlp, "gate_up_proj", None) is None for layer in model.layers):
            return None  # MoE layers (pkgd.runner.layers.moe): the C step has dense MLPs only
        attn = model.layers[0].self_attn
        if attn.head_dim % 16 or attn.num_heads > 256 or attn.num_heads % attn.num_kv_heads:
            return None
        linears = [
            m
            for layer in model.layers
            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        ]
        weight_dtype: int | None = W_QUANT
        if all(isinstance(m, QuantizedLinear) for m in linears):
            if any(m.qweight is None or m.qweight.rows != m.out_features for m in linears):
                return None
        elif any(getattr(m, "gemv_weight", None) is None or m.gemv_weight.dtype != model.dtype for m in linears):
            return None
        else:
            weight_dtype = _weight_dtype(model, linears)
        if weight_dtype is None:
            return None
        try:
            kernel = LlamaDecodeKernel(kernels)
        except CpuKernelsUnavailable as e:
            logger.warning("one_call_decode_unavailable", reason=str(e), fallback="per-layer forward")
            return None
        return cls(model, kernels, kernel, weight_dtype)

    def __call__(
        self, embeddings: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """``embeddings [T, H]`` of a step -> final hidden states ``[T, H]``, or None when this
        step is not one it serves (then nothing was computed or written)."""
        t = embeddings.shape[0]
        if (
            t > GEMV_MAX_BATCH
            or meta.num_decodes != t
            or meta.num_tokens != t
            or not self._bind_caches(kv_caches, meta.block_size)
            or (self.max_seq_len is not None and int(meta.seq_lens.max()) > self.max_seq_len)
        ):
            return None
        self.dims.bf16_impl = BF16_IMPLS[self.kernels.bf16_impl]
        if self.quantized:
            self.dims.quant_impl = QUANT_IMPLS[self.kernels.quant.impl]
        out = self.kernel.decode_forward(
            self.dims,
            self.layers,
            embeddings.float(),
            positions,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.shares_sequences,
        )
        return out if self.dtype == torch.float32 else out.to(self.dtype)

    def _bind_caches(self, kv_caches: list[KVCache], block_size: int) -> bool:
        """Point the layers at ``kv_caches`` (when they changed); False when the kernel cannot
        use them (not contiguous ``[num_blocks, block_size, Hkv, D]`` of one float dtype)."""
        key = (block_size, *(c.data_ptr() for kv in kv_caches for c in kv))
        if key == self._caches_key:
            return True
        d = self.dims
        want = (block_size, d.num_kv_heads, d.head_dim)
        dtype = kv_caches[0][0].dtype if kv_caches else None
        for k, v in kv_caches:
            for c in (k, v):
                if (
                    c.dtype != dtype
                    or dtype not in _KV_DTYPES
                    or not c.is_contiguous()
                    or tuple(c.shape[1:]) != want
                    or c.is_cuda
                ):
                    self._caches_key = None
                    return False
        assert dtype is not None  # a model has layers, so caches
        d.kv_dtype = _KV_DTYPES[dtype]
        for ptrs, (k, v) in zip(self.layers, kv_caches):
            ptrs.k_cache, ptrs.v_cache = k.data_ptr(), v.data_ptr()
        d.block_size = block_size
        self._caches_key = key
        return True

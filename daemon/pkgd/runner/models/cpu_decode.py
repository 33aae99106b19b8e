"""The whole decode step of a Llama-family model in one C call on CPU.

At batch 1 a token reads ~540 MB of float32 weights, ~10 ms at this machine's DRAM speed, and
the layer-by-layer forward adds ~300 Python-level op calls (norms, RoPE, cache writes,
attention, SiLU, module calls), ~7 ms more. `CpuDecodeStep` hands the whole step to
``pkgd_kernels.cpu`` (`CpuKernels.decode_forward`): every layer, in one OpenMP region, on the
same packed weights and KV cache the per-layer path uses, with the same arithmetic except for
the order of a few partial sums (its tests compare the two).

It serves a step when all of these hold, else the model's per-layer forward runs:

* CPU, float32 model, no tensor parallelism, the C kernels loaded;
* every linear's packed weight verified for the C GEMV (`layers.linear.verified_gemv_pointer`);
* ``head_dim % 16 == 0`` and at most 256 query heads;
* float32 contiguous KV caches;
* every sequence of the step is a decode (one new token) and there are at most
  `pkgd.runner.layers.linear.GEMV_MAX_BATCH` of them (beyond that the step is compute-bound
  and oneDNN's GEMM wins).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from pkgd_kernels.cpu import DecoderDims, DecoderLayerPointers

from pkgd.runner import ops
from pkgd.runner.attention import AttentionMetadata, KVCache
from pkgd.runner.layers.linear import GEMV_MAX_BATCH

# The model is a `pkgd.runner.models.llama.LlamaForCausalLM` (or a subclass); that module builds
# this step, so it is typed by what it is read for, not imported.
LlamaModel = Any


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class CpuDecodeStep:
    """Pointers to one loaded model's tensors, laid out for `CpuKernels.decode_forward`.

    Build with `CpuDecodeStep.build`; call it with a step's embeddings, positions, KV caches
    and metadata. It holds no tensors of its own: the model's parameters (and the runner's
    caches, re-read when they change) must outlive it, which they do as the model owns it.
    """

    def __init__(self, model: LlamaModel, kernels) -> None:
        cfg = model.cfg
        first = model.layers[0].self_attn
        self.kernels = kernels
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
            final_norm=model.norm.weight.data_ptr(),
            cos_sin_cache=model.rotary_emb.cos_sin_cache.data_ptr(),
        )
        self.layers = (DecoderLayerPointers * len(model.layers))()
        for ptrs, layer in zip(self.layers, model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            ptrs.ln1 = layer.input_layernorm.weight.data_ptr()
            ptrs.qkv, ptrs.qkv_bias = attn.qkv_proj.gemv_ptr, _ptr(attn.qkv_proj.bias)
            if attn.qk_norm:
                ptrs.q_norm, ptrs.k_norm = attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr()
            ptrs.o, ptrs.o_bias = attn.o_proj.gemv_ptr, _ptr(attn.o_proj.bias)
            ptrs.ln2 = layer.post_attention_layernorm.weight.data_ptr()
            ptrs.gate_up, ptrs.gate_up_bias = mlp.gate_up_proj.gemv_ptr, _ptr(mlp.gate_up_proj.bias)
            ptrs.down, ptrs.down_bias = mlp.down_proj.gemv_ptr, _ptr(mlp.down_proj.bias)
        self._caches_key: tuple[int, ...] | None = None

    @classmethod
    def build(cls, model: LlamaModel) -> CpuDecodeStep | None:
        """The step for ``model``, or None when it does not qualify (module docstring)."""
        kernels = ops.cpu_kernels()
        if kernels is None or model.dtype != torch.float32 or model.tp.size != 1 or model.norm.weight.is_cuda:
            return None
        attn = model.layers[0].self_attn
        if attn.head_dim % 16 or attn.num_heads > 256 or attn.num_heads % attn.num_kv_heads:
            return None
        linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if any(m.gemv_ptr is None for m in linears):
            return None
        return cls(model, kernels)

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
            or ops.cpu_kernels() is not self.kernels
            or not self._bind_caches(kv_caches, meta.block_size)
        ):
            return None
        return self.kernels.decode_forward(
            self.dims, self.layers, embeddings, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens
        )

    def _bind_caches(self, kv_caches: list[KVCache], block_size: int) -> bool:
        """Point the layers at ``kv_caches`` (when they changed); False when the kernel cannot
        use them (not float32 contiguous ``[num_blocks, block_size, Hkv, D]``)."""
        key = (block_size, *(c.data_ptr() for kv in kv_caches for c in kv))
        if key == self._caches_key:
            return True
        d = self.dims
        want = (block_size, d.num_kv_heads, d.head_dim)
        for k, v in kv_caches:
            for c in (k, v):
                if c.dtype != torch.float32 or not c.is_contiguous() or tuple(c.shape[1:]) != want or c.is_cuda:
                    self._caches_key = None
                    return False
        for ptrs, (k, v) in zip(self.layers, kv_caches):
            ptrs.k_cache, ptrs.v_cache = k.data_ptr(), v.data_ptr()
        d.block_size = block_size
        self._caches_key = key
        return True

"""pkgd_kernels: the kernels of pkgd's hot paths, one front door per op.

Every op ``<op>`` is a dispatcher: CUDA tensors go to ``<op>_triton`` (a Triton kernel); on
CPU, the C form (the method ``<op>`` of a `pkgd_kernels.cpu.CpuKernels` handle, passed as
``kernels=``) runs where one exists, is loaded and takes the tensors' layout, else
``<op>_cpu`` (PyTorch written for speed on CPU). ``<op>_ref`` (PyTorch, plain and checked)
defines what the op computes; every other form is tested against it. Forms share the
positional signature; dispatchers add keyword-only ``kernels`` (ops with a C form) and
``plan`` (attention: per-step work lists the CPU form reuses across layers).

=======================  ===========================================================
op                       what it computes
=======================  ===========================================================
reshape_and_cache        write this step's K/V into the paged cache (:mod:`.cache`)
paged_attention_decode   one query token per sequence over the paged cache (C form)
paged_attention_prefill  causal varlen attention over the paged cache, with cached
                         context (chunked prefill) (:mod:`.attention`)
rms_norm                 RMSNorm (:mod:`.norm`; C form)
fused_add_rms_norm       residual add, then RMSNorm (C form)
rotary_embedding         RoPE on query and key, NeoX or GPT-J pairing (:mod:`.rotary`)
silu_and_mul             SwiGLU gate (:mod:`.activation`)
gelu_tanh_and_mul        GeGLU gate, GELU's tanh form (:mod:`.activation`)
top_k_top_p_mask         top-k / top-p logit filtering (:mod:`.sampling`)
gemv_packed              ``x @ W^T`` for a few rows on oneDNN's packed weight (:mod:`.packed`;
                         CPU only: ``_ref`` and C form)
gather_packed            rows of such a packed weight (tied embedding lookup; CPU only)
quant_linear             ``x @ W^T`` on GGUF quantized blocks kept quantized, int8
                         activations (:mod:`.quant`, layout in :mod:`.quant_layout`;
                         CPU only: ``_ref`` and C form)
quant_gather             rows of such a quantized weight, dequantized (CPU only)
add_lora                 each token's LoRA update ``B[s] @ (A[s] @ x)`` added in place,
                         adapters batched by slot (:mod:`.lora`; Punica's BGMV)
=======================  ===========================================================

Importing this package never imports Triton: the ``*_triton`` modules holding the kernels
load on the first Triton call, so API processes and CPU-only machines stay light; the C
library is built and loaded only by `pkgd_kernels.cpu.load`. Tools: ``python -m
pkgd_kernels.bench`` (GPU timings vs the references) and ``python -m
pkgd_kernels.compile_check`` (compile every kernel for sm_90/sm_80 without a GPU).
"""

from pkgd_kernels.activation import (
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_cpu,
    gelu_tanh_and_mul_ref,
    gelu_tanh_and_mul_triton,
    silu_and_mul,
    silu_and_mul_cpu,
    silu_and_mul_ref,
    silu_and_mul_triton,
)
from pkgd_kernels.attention import (
    paged_attention_decode,
    paged_attention_decode_ref,
    paged_attention_decode_triton,
    paged_attention_prefill,
    paged_attention_prefill_ref,
    paged_attention_prefill_triton,
)
from pkgd_kernels.attention_cpu import paged_attention_decode_cpu, paged_attention_prefill_cpu
from pkgd_kernels.cache import (
    reshape_and_cache,
    reshape_and_cache_cpu,
    reshape_and_cache_ref,
    reshape_and_cache_triton,
)
from pkgd_kernels.lora import add_lora, add_lora_cpu, add_lora_ref, add_lora_triton
from pkgd_kernels.norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_cpu,
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm,
    rms_norm_cpu,
    rms_norm_ref,
    rms_norm_triton,
)
from pkgd_kernels.packed import gather_packed, gather_packed_ref, gemv_packed, gemv_packed_ref
from pkgd_kernels.quant import quant_gather, quant_gather_ref, quant_linear, quant_linear_ref
from pkgd_kernels.rotary import (
    rotary_embedding,
    rotary_embedding_cpu,
    rotary_embedding_ref,
    rotary_embedding_triton,
)
from pkgd_kernels.sampling import (
    top_k_top_p_mask,
    top_k_top_p_mask_cpu,
    top_k_top_p_mask_ref,
    top_k_top_p_mask_triton,
)

OPS = (
    "reshape_and_cache",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "top_k_top_p_mask",
    "add_lora",
)
"""Ops on every device: each has ``<name>``, ``<name>_ref``, ``<name>_cpu`` and ``<name>_triton``."""

CPU_OPS = ("gemv_packed", "gather_packed", "quant_linear", "quant_gather")
"""CPU-only ops (oneDNN's packing, GGUF's quantized blocks): each has ``<name>`` and
``<name>_ref``, and a C form."""

C_OPS = (
    "paged_attention_decode",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "rotary_embedding",
    "gemv_packed",
    "gather_packed",
    "quant_linear",
    "quant_gather",
)
"""Ops with a C form: a method of that name on `pkgd_kernels.cpu.CpuKernels`, with a
``takes_<name>`` predicate the dispatcher asks (``fused_add_rms_norm`` shares ``rms_norm``'s)."""

__all__ = [
    *(f"{op}{suffix}" for op in OPS for suffix in ("", "_ref", "_cpu", "_triton")),
    *(f"{op}{suffix}" for op in CPU_OPS for suffix in ("", "_ref")),
    "OPS",
    "CPU_OPS",
    "C_OPS",
]

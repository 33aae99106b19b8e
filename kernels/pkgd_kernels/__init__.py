"""pkgd_kernels: Triton kernels for pkgd's hot paths, each beside its PyTorch reference.

Every op comes in three forms with one signature: ``<op>_ref`` (PyTorch, vectorised, the CPU
path and the definition of what the op computes), ``<op>_triton`` (a Triton kernel) and
``<op>``, which runs the Triton kernel on CUDA tensors and the reference otherwise.

=======================  ===========================================================
op                       what it computes
=======================  ===========================================================
reshape_and_cache        write this step's K/V into the paged cache (:mod:`.cache`)
paged_attention_decode   one query token per sequence over the paged cache
paged_attention_prefill  causal varlen attention over the paged cache, with cached
                         context (chunked prefill) (:mod:`.attention`)
rms_norm                 RMSNorm (:mod:`.norm`)
fused_add_rms_norm       residual add, then RMSNorm
rotary_embedding         RoPE on query and key, NeoX or GPT-J pairing (:mod:`.rotary`)
silu_and_mul             SwiGLU gate (:mod:`.activation`)
top_k_top_p_mask         top-k / top-p logit filtering (:mod:`.sampling`)
=======================  ===========================================================

Importing this package never imports Triton: the ``*_triton`` modules holding the kernels
load on the first Triton call, so API processes and CPU-only machines stay light. Tools:
``python -m pkgd_kernels.bench`` (GPU timings vs the references) and
``python -m pkgd_kernels.compile_check`` (compile every kernel for sm_90/sm_80 without a GPU).
"""

from pkgd_kernels.activation import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton
from pkgd_kernels.attention import (
    paged_attention_decode,
    paged_attention_decode_ref,
    paged_attention_decode_triton,
    paged_attention_prefill,
    paged_attention_prefill_ref,
    paged_attention_prefill_triton,
)
from pkgd_kernels.cache import reshape_and_cache, reshape_and_cache_ref, reshape_and_cache_triton
from pkgd_kernels.norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm,
    rms_norm_ref,
    rms_norm_triton,
)
from pkgd_kernels.rotary import rotary_embedding, rotary_embedding_ref, rotary_embedding_triton
from pkgd_kernels.sampling import top_k_top_p_mask, top_k_top_p_mask_ref, top_k_top_p_mask_triton

OPS = (
    "reshape_and_cache",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "top_k_top_p_mask",
)
"""Names of the ops; each has ``<name>``, ``<name>_ref`` and ``<name>_triton`` here."""

__all__ = [f"{op}{suffix}" for op in OPS for suffix in ("", "_ref", "_triton")] + ["OPS"]

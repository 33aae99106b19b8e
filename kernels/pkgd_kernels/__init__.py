"""pkgd_kernels: Triton kernels for pkgd's hot paths, each beside its PyTorch reference.
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

"""pkgd_kernels: Triton kernels for pkgd's hot paths, each beside its PyTorch reference.
"""

from pkgd_kernels.cache import reshape_and_cache, reshape_and_cache_ref, reshape_and_cache_triton

"""KV-cache write: scatter this step's keys and values into the paged cache.

Layout (vLLM's, one pair per layer): ``key_cache`` and ``value_cache`` are each
``[num_blocks, block_size, num_kv_heads, head_dim]``; token ``t`` goes to slot
``slot_mapping[t] = block_id * block_size + offset_in_block``, i.e. to
``cache[slot // block_size, slot % block_size]``. A slot of -1 marks a token that is not
cached (padding); it is skipped. The op is vLLM's ``reshape_and_cache`` (Kwon et al. 2023,
"Efficient Memory Management for Large Language Model Serving with PagedAttention").
"""

from __future__ import annotations

import torch

from pkgd_kernels._util import (
    FLOAT_DTYPES,
    check_dtype,
    check_kv_cache,
    check_same,
    check_shape,
    next_power_of_2,
    on_device,
    triton_module,
    unit_stride,
    use_triton,
)

_OP = "reshape_and_cache"


def _check(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    mixed_cache: bool = False,
) -> None:
    _, _, num_kv_heads, head_dim = check_kv_cache(_OP, key_cache, value_cache)
    check_shape(_OP, "key", key, [None, num_kv_heads, head_dim])
    check_shape(_OP, "value", value, list(key.shape))
    check_shape(_OP, "slot_mapping", slot_mapping, [key.shape[0]])
    check_dtype(_OP, "slot_mapping", slot_mapping, [torch.int64])
    if mixed_cache:  # the CPU form also writes float32 K/V into a 16-bit cache, rounding
        check_dtype(_OP, "key", key, FLOAT_DTYPES)
        check_same(_OP, {"key": key, "value": value})
        check_same(_OP, {"key_cache": key_cache, "key": key}, dtype=False)
    else:
        check_same(_OP, {"key_cache": key_cache, "key": key, "value": value})
    check_same(_OP, {"key_cache": key_cache, "slot_mapping": slot_mapping}, dtype=False)


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` rows into the paged cache at ``slot_mapping`` (PyTorch reference).

    Args:
        key, value: ``[T, num_kv_heads, head_dim]``, the cache's dtype; any strides.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, written
            in place; any strides.
        slot_mapping: int64 ``[T]``; -1 skips the token.

    Raises:
        ValueError: shapes, dtypes or devices disagree, or a slot is below -1 or at/after
            ``num_blocks * block_size`` (checked before anything is written).
    """
    _check(key, value, key_cache, value_cache, slot_mapping)
    num_blocks, block_size = key_cache.shape[:2]
    bad = (slot_mapping < -1) | (slot_mapping >= num_blocks * block_size)
    if bool(bad.any()):
        raise ValueError(
            f"{_OP}: slot_mapping must lie in [-1, {num_blocks * block_size}), "
            f"got {slot_mapping[bad][0].item()} at token {int(bad.nonzero()[0, 0])}"
        )
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    # Two-index advanced assignment writes in place whatever the cache's strides.
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[keep]
    value_cache[blocks, offsets] = value[keep]


def reshape_and_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of :func:`reshape_and_cache_ref`: one program per (token, head tile).

    Same arguments. Shapes, dtypes and devices are checked (``ValueError``); slot values are
    not (that would need a device sync): a slot past the cache is undefined behaviour here.
    """
    _check(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    kernels = triton_module("cache_triton")
    block_d = next_power_of_2(head_dim)
    block_h = min(next_power_of_2(num_kv_heads), max(1, 4096 // block_d))
    with on_device(key):
        kernels.launch_reshape_and_cache(
            key, value, key_cache, value_cache, unit_stride(slot_mapping), block_h=block_h, block_d=block_d
        )


def reshape_and_cache_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """CPU form of :func:`reshape_and_cache_ref` (same arguments; unchecked): one
    ``index_copy_`` per contiguous cache over its ``[slots, Hkv, D]`` view (the reference's
    two-index assignment for other strides); float32 K/V written into a 16-bit cache are
    rounded to it."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    nb, bs, h, d = key_cache.shape
    if key.dtype != key_cache.dtype:
        key, value = key.to(key_cache.dtype), value.to(key_cache.dtype)
    for cache, rows in ((key_cache, key), (value_cache, value)):
        if cache.is_contiguous():
            cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, rows)
        else:
            cache[slot_mapping // bs, slot_mapping % bs] = rows


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write this step's keys and values into the paged KV cache, in place.

    Runs :func:`reshape_and_cache_triton` on CUDA tensors, :func:`reshape_and_cache_cpu`
    otherwise. See :func:`reshape_and_cache_ref` for shapes and errors; on CPU the cache may
    also be 16-bit under float32 K/V.
    """
    if use_triton(key):
        reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping)
        return
    _check(key, value, key_cache, value_cache, slot_mapping, mixed_cache=True)
    reshape_and_cache_cpu(key, value, key_cache, value_cache, slot_mapping)

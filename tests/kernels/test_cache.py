"""reshape_and_cache: reference vs a per-token loop, Triton (interpreted) vs reference, errors."""

from __future__ import annotations

import pytest
import torch

from pkgd_kernels import reshape_and_cache, reshape_and_cache_ref, reshape_and_cache_triton


def _inputs(generator, num_tokens, num_blocks, block_size, num_kv_heads, head_dim, skip_every=3):
    """Keys/values, empty caches and a slot mapping of distinct slots with some -1 entries."""
    shape = (num_tokens, num_kv_heads, head_dim)
    key = torch.randn(shape, generator=generator)
    value = torch.randn(shape, generator=generator)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = torch.zeros(cache_shape), torch.zeros(cache_shape)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[::skip_every] = -1
    return key, value, key_cache, value_cache, slots


def _naive(key, value, key_cache, value_cache, slot_mapping):
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            key_cache[slot // block_size, slot % block_size] = key[t]
            value_cache[slot // block_size, slot % block_size] = value[t]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_reference_matches_per_token_loop(generator, block_size):
    key, value, key_cache, value_cache, slots = _inputs(generator, 11, 12, block_size, 3, 8)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    _naive(key, value, want_k, want_v, slots)
    reshape_and_cache_ref(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)
    assert key_cache.abs().sum() > 0  # something was written


@pytest.mark.parametrize(
    "block_size,num_kv_heads,head_dim",
    [(1, 1, 16), (4, 3, 24), (16, 2, 64), (8, 5, 6)],
)
def test_triton_matches_reference(triton_interpreter, generator, block_size, num_kv_heads, head_dim):
    key, value, key_cache, value_cache, slots = _inputs(generator, 9, 10, block_size, num_kv_heads, head_dim)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_ref(key, value, want_k, want_v, slots)
    reshape_and_cache_triton(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


@pytest.mark.parametrize("block_h", [1, 2])
def test_triton_head_tiles_and_strided_inputs(triton_interpreter, generator, block_h):
    """Keys/values as views into one fused QKV row (strided), heads split over several tiles."""
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 6, 4, 3, 8, 4
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    _, key, value = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = value.view(num_tokens, num_kv_heads, head_dim)
    # A cache that is a non-contiguous slice of a joint [num_blocks, 2, ...] allocation.
    joint = torch.zeros(5, 2, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = joint[:, 0], joint[:, 1]
    slots = torch.tensor([3, -1, 0, 17, 9, 12])
    want = joint.clone()
    reshape_and_cache_ref(key, value, want[:, 0], want[:, 1], slots)
    from pkgd_kernels import cache_triton

    cache_triton.launch_reshape_and_cache(key, value, key_cache, value_cache, slots, block_h=block_h, block_d=8)
    assert torch.equal(joint, want)


def test_dispatcher_on_cpu_runs_reference(generator):
    key, value, key_cache, value_cache, slots = _inputs(generator, 5, 3, 4, 2, 4)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_ref(key, value, want_k, want_v, slots)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda a: a.update(key=a["key"][:, :, :-1]), "key must have shape"),
        (lambda a: a.update(value=a["value"][:-1]), "value must have shape"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"].int()), "slot_mapping must be int64"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"][:-1]), "slot_mapping must have shape"),
        (lambda a: a.update(value_cache=a["value_cache"][:-1]), "value_cache must have shape"),
        (lambda a: a.update(key=a["key"].double()), "key_cache"),
    ],
)
@pytest.mark.parametrize("op", [reshape_and_cache_ref, reshape_and_cache_triton])
def test_bad_shapes_raise_and_write_nothing(generator, op, mutate, message):
    key, value, key_cache, value_cache, slots = _inputs(generator, 4, 2, 4, 2, 4)
    args = dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slots)
    mutate(args)
    with pytest.raises(ValueError, match=message):
        op(**args)
    assert key_cache.abs().sum() == 0 and value_cache.abs().sum() == 0


@pytest.mark.parametrize("bad_slot", [-2, 8])
def test_reference_rejects_slots_outside_the_cache(generator, bad_slot):
    key, value, key_cache, value_cache, slots = _inputs(generator, 4, 2, 4, 2, 4, skip_every=5)
    slots[2] = bad_slot
    with pytest.raises(ValueError, match=r"slot_mapping must lie in \[-1, 8\)"):
        reshape_and_cache_ref(key, value, key_cache, value_cache, slots)
    assert key_cache.abs().sum() == 0

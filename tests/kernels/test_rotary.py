"""rotary_embedding: reference vs complex-number rotation, Triton (interpreted) vs reference.
Tolerances: float32 atol/rtol 1e-6 (FMA contraction may differ); float16 one ulp (rtol 2**-10)."""

from __future__ import annotations

import pytest
import torch

from pkgd_kernels import rotary_embedding, rotary_embedding_ref, rotary_embedding_triton

FP32 = dict(atol=1e-6, rtol=1e-6)


def _cos_sin_cache(max_position: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    """vLLM's table: [max_position, rot_dim], cos of pos * inv_freq then sin."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def _naive(x, positions, head_size, cache, is_neox):
    """Rotate each channel pair as a complex number by e^(i * angle)."""
    rot_dim = cache.shape[1]
    heads = x.double().view(x.shape[0], -1, head_size).clone()
    rot = heads[..., :rot_dim]
    if is_neox:  # pair (i, i + rot_dim/2): gather the pairs next to each other first
        pairs = torch.stack(rot.chunk(2, dim=-1), dim=-1)
    else:
        pairs = rot.unflatten(-1, (rot_dim // 2, 2))
    cos, sin = cache.double()[positions].chunk(2, dim=-1)
    turned = torch.view_as_complex(pairs.contiguous()) * torch.complex(cos, sin)[:, None, :]
    turned = torch.view_as_real(turned)  # [..., rot_dim/2, 2]: (a, b) of each pair
    if is_neox:
        heads[..., :rot_dim] = torch.cat(turned.unbind(-1), dim=-1)
    else:
        heads[..., :rot_dim] = turned.flatten(-2)
    return heads.view(x.shape).to(x.dtype)


def _inputs(generator, num_tokens, num_heads, num_kv_heads, head_size, max_position=32):
    positions = torch.randint(0, max_position, (num_tokens,), generator=generator)
    positions[0], positions[-1] = 0, max_position - 1
    query = torch.randn(num_tokens, num_heads * head_size, generator=generator)
    key = torch.randn(num_tokens, num_kv_heads * head_size, generator=generator)
    return positions, query, key


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_size,rot_dim", [(8, 8), (12, 4)])
def test_reference_matches_complex_rotation(generator, is_neox, head_size, rot_dim):
    positions, query, key = _inputs(generator, 5, 3, 1, head_size)
    cache = _cos_sin_cache(32, rot_dim)
    q, k = rotary_embedding_ref(positions, query, key, head_size, cache, is_neox)
    torch.testing.assert_close(q, _naive(query, positions, head_size, cache, is_neox), **FP32)
    torch.testing.assert_close(k, _naive(key, positions, head_size, cache, is_neox), **FP32)
    tail = q.view(5, 3, head_size)[..., rot_dim:]
    assert torch.equal(tail, query.view(5, 3, head_size)[..., rot_dim:])  # partial rotary


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,rot_dim,block_h",
    [(4, 2, 8, 8, 2), (3, 1, 12, 6, 1), (2, 2, 16, 8, 4), (5, 1, 6, 6, 16)],
)
def test_triton_matches_reference(
    triton_interpreter, generator, is_neox, num_heads, num_kv_heads, head_size, rot_dim, block_h
):
    from pkgd_kernels import rotary_triton

    positions, query, key = _inputs(generator, 6, num_heads, num_kv_heads, head_size)
    cache = _cos_sin_cache(32, rot_dim)
    want_q, want_k = rotary_embedding_ref(positions, query, key, head_size, cache, is_neox)
    for x, want in ((query, want_q), (key, want_k)):
        out = torch.empty_like(x)
        block_d = max(8, 1 << (head_size - 1).bit_length())
        rotary_triton.launch_rotary_embedding(
            positions, x, out, head_size, cache, is_neox, block_h=block_h, block_d=block_d
        )
        torch.testing.assert_close(out, want, **FP32)


def test_triton_public_function_strided_and_fp16(triton_interpreter, generator):
    """Query and key as views into a fused QKV row, in float16, with a float32 table."""
    num_tokens, num_heads, num_kv_heads, head_size = 4, 2, 1, 8
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=generator)
    query, key, _ = qkv.half().split([16, 8, 8], dim=-1)
    positions = torch.tensor([0, 5, 2, 31])
    cache = _cos_sin_cache(32, head_size)
    got = rotary_embedding_triton(positions, query, key, head_size, cache, True)
    want = rotary_embedding_ref(positions, query, key, head_size, cache, True)
    assert got[0].dtype == torch.float16 and got[0].is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=2**-10)
    assert torch.equal(query, qkv.half()[:, :16])  # inputs untouched


def test_dispatcher_on_cpu_runs_the_reference(generator):
    positions, query, key = _inputs(generator, 3, 2, 1, 8)
    cache = _cos_sin_cache(32, 8)
    got = rotary_embedding(positions, query, key, 8, cache, True)
    want = rotary_embedding_ref(positions, query, key, 8, cache, True)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("op", [rotary_embedding_ref, rotary_embedding_triton])
@pytest.mark.parametrize(
    "change,message",
    [
        (dict(positions=torch.zeros(3, dtype=torch.int32)), "positions must be int64"),
        (dict(query=torch.zeros(3, 15)), r"query must have shape \[T, heads \* 8\]"),
        (dict(key=torch.zeros(2, 8)), "key must have shape"),
        (dict(key=torch.zeros(3, 8, dtype=torch.float16)), "key is torch.float16"),
        (dict(cos_sin_cache=torch.zeros(32, 10)), "rot_dim even and 0 < rot_dim <= head_size"),
        (dict(cos_sin_cache=torch.zeros(32, 5)), "rot_dim even"),
        (dict(head_size=0), "head_size must be > 0"),
    ],
)
def test_bad_inputs_raise(op, change, message):
    args = dict(
        positions=torch.zeros(3, dtype=torch.int64),
        query=torch.zeros(3, 16),
        key=torch.zeros(3, 8),
        head_size=8,
        cos_sin_cache=torch.zeros(32, 8),
        is_neox=True,
    )
    args.update(change)
    with pytest.raises(ValueError, match=message):
        op(**args)


def test_reference_rejects_positions_outside_the_table():
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 32\), got 32"):
        rotary_embedding_ref(torch.tensor([0, 32]), torch.zeros(2, 8), torch.zeros(2, 8), 8, torch.zeros(32, 8), True)

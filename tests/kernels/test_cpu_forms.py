"""Every op's CPU PyTorch form (``<op>_cpu``, what the dispatchers run on CPU without a C form)
against its reference, including the CPU-only freedoms: 16-bit caches under float32 queries and
per-step plans reused across calls; and the packed-weight ops' references against a dense
product."""

from __future__ import annotations

import pytest
import torch

import pkgd_kernels as K
from pkgd_kernels import attention_cpu

from .paged import make_batch, zero_padding

CLOSE = dict(atol=1e-5, rtol=1e-5)

# (seq_lens, q_lens, Hq, Hkv, D, block_size): decodes of ragged lengths, whole prompts, chunks
# after cached context
DECODE_CASES = [([1, 5, 17, 30, 9], 6, 2, 16, 4), ([8, 8, 8], 4, 4, 8, 4), ([40, 3], 8, 1, 32, 16)]
PREFILL_CASES = [([12, 7, 20], [5, 7, 1], 6, 2, 16, 4), ([7, 20, 5, 16], [7, 5, 1, 16], 2, 2, 8, 4)]


@pytest.mark.parametrize("seq_lens,hq,hkv,d,bs", DECODE_CASES)
@pytest.mark.parametrize("chunk_bytes", [None, 2 * 8 * 2 * 16 * 4 * 2])  # default, ~2 sequences a chunk
def test_decode_cpu_matches_the_reference(generator, monkeypatch, seq_lens, hq, hkv, d, bs, chunk_bytes):
    if chunk_bytes:
        monkeypatch.setattr(attention_cpu, "DECODE_CHUNK_BYTES", chunk_bytes)
    b = zero_padding(
        make_batch(generator, seq_lens, [1] * len(seq_lens), num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs)
    )
    want = K.paged_attention_decode_ref(*b.decode_args, 0.3)
    torch.testing.assert_close(K.paged_attention_decode_cpu(*b.decode_args, 0.3), want, **CLOSE)
    plan = attention_cpu.plan_decode(
        b.block_tables, seq_lens, bs, attention_cpu.kv_bytes_per_token(b.query, b.key_cache)
    )
    if chunk_bytes and hkv == 2:
        assert len(plan) > 2 and plan[-1].seq_end == len(seq_lens)
    torch.testing.assert_close(K.paged_attention_decode_cpu(*b.decode_args, 0.3, plan=plan), want, **CLOSE)


@pytest.mark.parametrize("seq_lens,q_lens,hq,hkv,d,bs", PREFILL_CASES)
def test_prefill_cpu_matches_the_reference(generator, seq_lens, q_lens, hq, hkv, d, bs):
    b = zero_padding(make_batch(generator, seq_lens, q_lens, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs))
    want = K.paged_attention_prefill_ref(*b.prefill_args, 0.25)
    torch.testing.assert_close(K.paged_attention_prefill_cpu(*b.prefill_args, 0.25), want, **CLOSE)
    plan = attention_cpu.plan_prefill(b.block_tables, b.query_start_loc.tolist(), seq_lens, bs)
    assert [p.mask is None for p in plan] == [q == n for q, n in zip(q_lens, seq_lens)]  # no context: causal
    torch.testing.assert_close(K.paged_attention_prefill_cpu(*b.prefill_args, 0.25, plan=plan), want, **CLOSE)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_cache_under_float32_queries(generator, cache_dtype):
    b = zero_padding(make_batch(generator, [9, 4], [1, 4], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4))
    kc, vc = b.key_cache.to(cache_dtype), b.value_cache.to(cache_dtype)
    args = (b.query, kc, vc, b.block_tables, b.query_start_loc, b.seq_lens)
    want = K.paged_attention_prefill_ref(b.query, kc.float(), vc.float(), *args[3:], 0.25)
    got = K.paged_attention_prefill(*args, 0.25)  # the dispatcher accepts the mix on CPU
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **CLOSE)
    with pytest.raises(ValueError, match="query is torch.float32"):
        K.paged_attention_prefill_ref(*args, 0.25)  # the reference keeps one dtype
    key, value = torch.randn(2, 2, 16, generator=generator), torch.randn(2, 2, 16, generator=generator)
    K.reshape_and_cache(key, value, kc, vc, torch.tensor([0, 6]))
    assert torch.equal(kc[1, 2], key[1].to(cache_dtype)) and torch.equal(vc[0, 0], value[0].to(cache_dtype))


def test_reshape_and_cache_cpu_matches_the_reference_and_skips_negative_slots(generator):
    caches = [torch.zeros(4, 4, 2, 16) for _ in range(4)]
    k, v, slots = (
        torch.randn(3, 2, 16, generator=generator),
        torch.randn(3, 2, 16, generator=generator),
        torch.tensor([5, -1, 9]),
    )
    K.reshape_and_cache_cpu(k, v, caches[0], caches[1], slots)
    K.reshape_and_cache_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert int((caches[0] != 0).any(-1).any(-1).sum()) == 2
    strided = torch.zeros(4, 4, 2, 32)[..., :16]  # not contiguous: the two-index assignment
    K.reshape_and_cache_cpu(k, v, strided, strided.clone(), slots)
    assert torch.equal(strided, caches[2])


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [16, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_cpu_matches_the_reference(generator, is_neox, rot_dim, dtype):
    pos = torch.tensor([0, 3, 1, 9, 2, 15, 4])
    inv = 1.0 / 10000.0 ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    freqs = torch.outer(torch.arange(32).float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], -1)
    qkv = torch.randn(7, (6 + 2 + 2) * 16, generator=generator).to(dtype)
    q, k = qkv[:, : 6 * 16], qkv[:, 6 * 16 : 8 * 16]  # views into a fused QKV row, as the model has
    want = K.rotary_embedding_ref(pos, q, k, 16, cache, is_neox)
    got = K.rotary_embedding_cpu(pos, q, k, 16, cache, is_neox)
    tol = CLOSE if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for a, b in zip(got, want):
        assert a.dtype == dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_silu_cpu_match_the_references(generator, dtype):
    x, r = (torch.randn(5, 32, generator=generator).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(32, generator=generator)).to(dtype)
    tol = CLOSE if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(K.rms_norm_cpu(x, w, 1e-6), K.rms_norm_ref(x, w, 1e-6), **tol)
    for a, b in zip(K.fused_add_rms_norm_cpu(x, r, w, 1e-6), K.fused_add_rms_norm_ref(x, r, w, 1e-6)):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, **tol)
    y = torch.randn(4, 2 * 24, generator=generator).to(dtype)
    torch.testing.assert_close(K.silu_and_mul_cpu(y), K.silu_and_mul_ref(y), **tol)


@pytest.mark.parametrize("top_p", [1.0, 0.5])  # top-k only: the one-topk path; else the reference's
def test_top_k_top_p_mask_cpu_matches_the_reference(generator, top_p):
    logits = torch.randn(6, 300, generator=generator)
    logits[1, :4] = 3.0  # ties at the boundary
    top_k = torch.tensor([0, 2, 10, 1, 0, 400], dtype=torch.int32)
    top_p = torch.tensor([top_p, 1.0, top_p, 0.9 if top_p < 1 else 1.0, top_p, 1.0])
    assert torch.equal(K.top_k_top_p_mask_cpu(logits, top_k, top_p), K.top_k_top_p_mask_ref(logits, top_k, top_p))


@pytest.mark.parametrize("m", [0, 1, 5])
def test_packed_references_read_the_packing(generator, m):
    n, k = 192, 40
    w = torch.randn(n, k, generator=generator)
    packed = w.view(n // 64, 64, k).transpose(1, 2).contiguous()  # [N/64][K][64]
    x, bias = torch.randn(m, k, generator=generator), torch.randn(n, generator=generator)
    torch.testing.assert_close(K.gemv_packed_ref(x, packed, bias), x @ w.t() + bias, **CLOSE)
    torch.testing.assert_close(K.gemv_packed(x, packed, None), x @ w.t(), **CLOSE)  # no kernels: the reference
    ids = torch.tensor([0, 63, 64, 191, 5])
    assert torch.equal(K.gather_packed_ref(packed, ids), w[ids]) and torch.equal(K.gather_packed(packed, ids), w[ids])
    with pytest.raises(IndexError):
        K.gather_packed_ref(packed, torch.tensor([192]))
    with pytest.raises(ValueError, match="weight must have shape"):
        K.gemv_packed_ref(x, packed.view(-1, k, 32), None)

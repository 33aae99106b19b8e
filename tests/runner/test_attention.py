"""The CPU paged-attention path and dense ops against naive dense references."""

from __future__ import annotations

import pytest
import torch

from pkgd.runner import attention as A
from pkgd.runner import ops

HQ, HKV, D, BS = 6, 2, 16, 4


def _dense_attention(q, k, v, q_pos, scale):
    """q [n, Hq, D] at positions q_pos attend to k/v [L, Hkv, D] positions 0..q_pos."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("nhd,lhd->hnl", q, k) * scale
    mask = torch.arange(k.shape[0])[None, :] > torch.tensor(q_pos)[:, None]
    s = s.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def _setup(seq_lens, num_blocks=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(num_blocks, BS, HKV, D, generator=g)
    vc = torch.randn(num_blocks, BS, HKV, D, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    rows, k_full, v_full = [], [], []
    for n in seq_lens:
        nb = -(-n // BS)
        rows.append([perm.pop() for _ in range(nb)])
        idx = torch.tensor(rows[-1])
        k_full.append(kc[idx].reshape(-1, HKV, D)[:n])
        v_full.append(vc[idx].reshape(-1, HKV, D)[:n])
    width = max(len(r) for r in rows)
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    return kc, vc, table, k_full, v_full


def test_decode_matches_dense_with_gqa_and_ragged_lengths(cpu_path):
    lens = [1, 5, 17, 30, 9]
    kc, vc, table, ks, vs = _setup(lens)
    q = torch.randn(len(lens), HQ, D)
    out = A.paged_attention_decode(q, kc, vc, table, torch.tensor(lens, dtype=torch.int32), 0.25)
    for s, n in enumerate(lens):
        want = _dense_attention(q[s : s + 1], ks[s], vs[s], [n - 1], 0.25)
        torch.testing.assert_close(out[s : s + 1], want, atol=1e-5, rtol=1e-5)


def test_decode_chunks_split_large_batches(monkeypatch):
    monkeypatch.setattr(A, "DECODE_CHUNK_BYTES", 2 * 8 * HKV * D * 4 * 2)  # ~2 sequences a chunk
    lens = [8, 3, 7, 8, 2, 6, 5]
    kc, vc, table, ks, vs = _setup(lens)
    chunks = A._decode_chunks(table, lens, BS, 2 * HKV * D * 4)
    assert len(chunks) > 2 and chunks[-1].seq_end == len(lens)
    q = torch.randn(len(lens), HQ, D)
    out = A._decode_cpu(q, kc, vc, chunks, 0.3)
    for s, n in enumerate(lens):
        torch.testing.assert_close(out[s : s + 1], _dense_attention(q[s : s + 1], ks[s], vs[s], [n - 1], 0.3), atol=1e-5, rtol=1e-5)


def test_prefill_with_cached_context_matches_dense():
    lens, q_lens = [12, 7, 20], [5, 7, 1]
    kc, vc, table, ks, vs = _setup(lens)
    qsl = torch.tensor([0, 5, 12, 13], dtype=torch.int32)
    q = torch.randn(13, HQ, D)
    out = A.paged_attention_prefill(q, kc, vc, table, qsl, torch.tensor(lens, dtype=torch.int32), 0.25)
    for s, (n, ql) in enumerate(zip(lens, q_lens)):
        a, b = qsl[s].item(), qsl[s + 1].item()
        want = _dense_attention(q[a:b], ks[s], vs[s], list(range(n - ql, n)), 0.25)
        torch.testing.assert_close(out[a:b], want, atol=1e-5, rtol=1e-5)


def test_layer_entry_point_mixed_batch_writes_cache_and_attends(cpu_path):
    # sequences: decode (ctx 6), fresh prompt of 5, chunk of 4 over 3 cached tokens
    q_lens, seq_lens = [1, 5, 4], [7, 5, 7]
    kc, vc, table, _, _ = _setup([7, 5, 7])
    ctx_k = [kc[table[s].long()].reshape(-1, HKV, D)[: seq_lens[s] - q_lens[s]].clone() for s in range(3)]
    ctx_v = [vc[table[s].long()].reshape(-1, HKV, D)[: seq_lens[s] - q_lens[s]].clone() for s in range(3)]
    t = sum(q_lens)
    q, k, v = torch.randn(t, HQ, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    slots, rows = [], [[int(b) for b in table[s][: -(-seq_lens[s] // BS)]] for s in range(3)]
    for s in range(3):
        for p in range(seq_lens[s] - q_lens[s], seq_lens[s]):
            slots.append(rows[s][p // BS] * BS + p % BS)
    meta = A.AttentionMetadata.build(query_lens=q_lens, seq_lens=seq_lens, block_table_rows=rows, slot_mapping=torch.tensor(slots), block_size=BS, kv_bytes_per_token=2 * HKV * D * 4, device=torch.device("cpu"))
    assert meta.num_decodes == 1 and [p.block_ids is None for p in meta.prefills] == [True, False]
    out = A.paged_attention(q, k, v, (kc, vc), meta, 0.2)
    start = 0
    for s in range(3):
        n = q_lens[s]
        kk = torch.cat([ctx_k[s], k[start : start + n]])
        vv = torch.cat([ctx_v[s], v[start : start + n]])
        want = _dense_attention(q[start : start + n], kk, vv, list(range(seq_lens[s] - n, seq_lens[s])), 0.2)
        torch.testing.assert_close(out[start : start + n], want, atol=1e-5, rtol=1e-5)
        start += n


def test_reshape_and_cache_skips_negative_slots():
    kc, vc = torch.zeros(4, BS, HKV, D), torch.zeros(4, BS, HKV, D)
    k, v = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    A.reshape_and_cache(k, v, kc, vc, torch.tensor([5, -1, 0]))
    assert torch.equal(kc[1, 1], k[0]) and torch.equal(vc[0, 0], v[2])
    assert int((kc != 0).any(-1).any(-1).sum()) == 2


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [D, D // 2])
def test_rotary_embedding_matches_complex_rotation(is_neox, rot_dim):
    t, theta = 7, 10000.0
    pos = torch.tensor([0, 3, 1, 9, 2, 15, 4])
    inv = 1.0 / theta ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    freqs = torch.outer(torch.arange(32).float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], -1)
    q, k = torch.randn(t, HQ * D), torch.randn(t, HKV * D)
    rq, rk = ops.rotary_embedding(pos, q, k, D, cache, is_neox)

    def ref(x):
        x = x.view(t, -1, D)
        r = x[..., :rot_dim]
        if is_neox:
            c = torch.complex(r[..., : rot_dim // 2], r[..., rot_dim // 2 :])
        else:
            c = torch.complex(r[..., 0::2], r[..., 1::2])
        c = c * torch.polar(torch.ones_like(freqs[pos]), freqs[pos])[:, None, :]
        rr = torch.cat([c.real, c.imag], -1) if is_neox else torch.stack([c.real, c.imag], -1).flatten(-2)
        return torch.cat([rr, x[..., rot_dim:]], -1).reshape(t, -1)

    torch.testing.assert_close(rq, ref(q), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rk, ref(k), atol=1e-5, rtol=1e-5)


def test_norms_and_silu_and_mul():
    x, r, w = torch.randn(5, 32), torch.randn(5, 32), torch.randn(32)
    ref = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ref)
    out, res = ops.fused_add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(res, x + r)
    torch.testing.assert_close(out, ops.rms_norm(x + r, w, 1e-6))
    xb = x.to(torch.bfloat16)
    assert ops.rms_norm(xb, w.to(torch.bfloat16), 1e-6).dtype == torch.bfloat16
    y = torch.randn(4, 2 * 24)
    torch.testing.assert_close(ops.silu_and_mul(y), torch.nn.functional.silu(y[:, :24]) * y[:, 24:])


def _kernel_ref(name: str):
    import pkgd_kernels

    ref = getattr(pkgd_kernels, f"{name}_ref", None)
    if ref is None:
        pytest.skip(f"pkgd_kernels has no {name}_ref yet")
    return ref


def test_cpu_paths_agree_with_pkgd_kernels_references():
    """Once the kernels package provides its PyTorch references, the runner's CPU path (same
    signatures) must agree with them."""
    lens = [3, 9, 16]
    kc, vc, table, _, _ = _setup(lens)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(3, HQ, D)
    ref = _kernel_ref("paged_attention_decode")
    torch.testing.assert_close(A.paged_attention_decode(q, kc, vc, table, seq_lens, 0.3), ref(q, kc, vc, table, seq_lens, 0.3), atol=1e-5, rtol=1e-5)
    qsl = torch.tensor([0, 2, 9, 13], dtype=torch.int32)
    qp = torch.randn(13, HQ, D)
    ref = _kernel_ref("paged_attention_prefill")
    got = A.paged_attention_prefill(qp, kc, vc, table, qsl, seq_lens, 0.3)
    torch.testing.assert_close(got, ref(qp, kc, vc, table, qsl, seq_lens, 0.3), atol=1e-5, rtol=1e-5)
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), _kernel_ref("rms_norm")(x, w, 1e-6))
    torch.testing.assert_close(ops.silu_and_mul(torch.cat([x, r], 1)), _kernel_ref("silu_and_mul")(torch.cat([x, r], 1)))


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_cache_write_and_sampling_mask_agree_with_pkgd_kernels_references(is_neox):
    from pkgd.runner.sampler import top_k_top_p_mask

    pos = torch.tensor([0, 5, 2, 7])
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2).float() / D)
    freqs = torch.outer(torch.arange(16).float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], -1)
    q, k = torch.randn(4, HQ * D), torch.randn(4, HKV * D)
    want = _kernel_ref("rotary_embedding")(pos, q, k, D, cache, is_neox)
    got = ops.rotary_embedding(pos, q, k, D, cache, is_neox)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    for a, b in zip(ops.fused_add_rms_norm(x, r, w, 1e-6), _kernel_ref("fused_add_rms_norm")(x, r, w, 1e-6)):
        torch.testing.assert_close(a, b)
    caches = [torch.zeros(4, BS, HKV, D) for _ in range(4)]
    kk, vv, slots = torch.randn(3, HKV, D), torch.randn(3, HKV, D), torch.tensor([5, -1, 9])
    A.reshape_and_cache(kk, vv, caches[0], caches[1], slots)
    _kernel_ref("reshape_and_cache")(kk, vv, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    logits = torch.randn(5, 50)
    logits[1, :4] = 3.0  # ties at the boundary
    top_k = torch.tensor([0, 2, 10, 1, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 0.5, 0.9, 0.3], dtype=torch.float32)
    torch.testing.assert_close(top_k_top_p_mask(logits, top_k, top_p), _kernel_ref("top_k_top_p_mask")(logits, top_k, top_p))


def test_decode_goes_through_the_c_kernel_when_loaded(cpu_path, monkeypatch):
    calls = []
    kernels = ops.cpu_kernels()
    if kernels is not None:
        real = kernels.paged_attention_decode
        monkeypatch.setattr(kernels, "paged_attention_decode", lambda *a: calls.append(1) or real(*a))
    lens = [3, 9]
    kc, vc, table, ks, vs = _setup(lens)
    q = torch.randn(len(lens), HQ, D)
    out = A.paged_attention_decode(q, kc, vc, table, torch.tensor(lens, dtype=torch.int32), 0.25)
    assert len(calls) == (1 if cpu_path == "c-kernels" else 0)
    for s, n in enumerate(lens):
        torch.testing.assert_close(out[s : s + 1], _dense_attention(q[s : s + 1], ks[s], vs[s], [n - 1], 0.25), atol=1e-5, rtol=1e-5)

"""The layer entry point of attention (`pkgd.runner.attention.paged_attention`) and its step
metadata, on both CPU paths, against a naive dense reference. The ops it calls are tested in
tests/kernels."""

from __future__ import annotations

import torch

from pkgd.runner import attention as A

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
    meta = A.AttentionMetadata.build(
        query_lens=q_lens,
        seq_lens=seq_lens,
        block_table_rows=rows,
        slot_mapping=torch.tensor(slots),
        block_size=BS,
        kv_bytes_per_token=2 * HKV * D * 4,
        device=torch.device("cpu"),
    )
    assert meta.num_decodes == 1 and [p.mask is None for p in meta.prefill_plan()] == [True, False]
    assert meta.decode_plan() is meta.decode_plan()  # built once a step, shared by every layer
    out = A.paged_attention(q, k, v, (kc, vc), meta, 0.2, cpu_path)
    start = 0
    for s in range(3):
        n = q_lens[s]
        kk = torch.cat([ctx_k[s], k[start : start + n]])
        vv = torch.cat([ctx_v[s], v[start : start + n]])
        want = _dense_attention(q[start : start + n], kk, vv, list(range(seq_lens[s] - n, seq_lens[s])), 0.2)
        torch.testing.assert_close(out[start : start + n], want, atol=1e-5, rtol=1e-5)
        start += n


def test_decode_goes_through_the_c_kernel_when_loaded(cpu_path, monkeypatch):
    calls = []
    if cpu_path is not None:
        real = cpu_path.paged_attention_decode
        monkeypatch.setattr(cpu_path, "paged_attention_decode", lambda *a: calls.append(1) or real(*a))
    lens = [3, 9]
    kc, vc, table, ks, vs = _setup(lens)
    rows = [[int(b) for b in table[s][: -(-n // BS)]] for s, n in enumerate(lens)]
    slots = torch.tensor([rows[s][(n - 1) // BS] * BS + (n - 1) % BS for s, n in enumerate(lens)])
    meta = A.AttentionMetadata.build(
        query_lens=[1, 1],
        seq_lens=lens,
        block_table_rows=rows,
        slot_mapping=slots,
        block_size=BS,
        kv_bytes_per_token=2 * HKV * D * 4,
        device=torch.device("cpu"),
    )
    q, k, v = torch.randn(2, HQ, D), torch.randn(2, HKV, D), torch.randn(2, HKV, D)
    out = A.paged_attention(q, k, v, (kc, vc), meta, 0.25, cpu_path)
    assert len(calls) == (1 if cpu_path is not None else 0)
    assert (meta._decode_plan is None) == (cpu_path is not None)  # the PyTorch form's plan: built only for it
    for s, n in enumerate(lens):
        kk, vv = torch.cat([ks[s][: n - 1], k[s : s + 1]]), torch.cat([vs[s][: n - 1], v[s : s + 1]])
        torch.testing.assert_close(
            out[s : s + 1], _dense_attention(q[s : s + 1], kk, vv, [n - 1], 0.25), atol=1e-5, rtol=1e-5
        )

"""The CPU linears before and after `process_weights_after_loading` (oneDNN packing)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from tests.runner.factory import onednn_bf16_view_expected

from pkgd.runner.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pkgd.runner.layers.linear import ONEDNN_LINEAR, MergedColumnParallelLinear, RowParallelLinear, onednn_packs_bf16

_nothing = contextlib.nullcontext


@pytest.mark.skipif(not ONEDNN_LINEAR, reason="this torch build has no oneDNN packed linear")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linears_compute_what_the_dense_ones_did(bias):
    g = torch.Generator().manual_seed(0)
    col = MergedColumnParallelLinear(48, [32, 16, 16], bias=bias)
    row = RowParallelLinear(64, 48, bias=bias)
    full = [torch.randn(n, 48, generator=g) for n in (32, 16, 16)]
    for i, w in enumerate(full):
        col.load_part(i, w)
        if bias:
            col.load_part(i, torch.randn(w.shape[0], generator=g), "bias")
    row.load(torch.randn(48, 64, generator=g))
    if bias:
        row.load(torch.randn(48, generator=g), "bias")
    xs = [torch.randn(m, 48, generator=g) for m in (0, 1, 7, 64, 300)]
    want_col = [col(x) for x in xs]
    want_row = [row(F.silu(y)) for y in want_col]
    for layer in (col, row):
        layer.process_weights_after_loading()
        assert layer.packed and layer.weight.is_mkldnn
        layer.process_weights_after_loading()  # idempotent
    for x, wc, wr in zip(xs, want_col, want_row):
        got = col(x)
        assert got.shape == wc.shape
        torch.testing.assert_close(got, wc, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(row(F.silu(got)), wr, rtol=1e-5, atol=1e-5)
    # a strided input (a slice of the fused QKV output) works too
    wide = torch.randn(5, 96, generator=g)
    torch.testing.assert_close(col(wide[:, :48]), col(wide[:, :48].contiguous()))


def test_float16_weights_stay_dense():
    layer = MergedColumnParallelLinear(8, [8], bias=False, dtype=torch.float16)
    layer.process_weights_after_loading()
    assert not layer.packed and not layer.weight.is_mkldnn


@pytest.mark.skipif(not ONEDNN_LINEAR, reason="this torch build has no oneDNN packed linear")
def test_bf16_linears_are_packed_and_agree(cpu_path):
    """bf16 weights are packed for oneDNN too where it packs bf16 (its bf16 GEMM on the packed
    weight was ~1.3-1.5x F.linear's at 64-256 rows on an AMX host); where the packing is one the
    C GEMV reads, a few rows take it on the same buffer; on an AVX2-only host the weight stays a
    plain tensor. The outputs agree with the unpacked layer's in every case."""
    g = torch.Generator().manual_seed(3)
    col = MergedColumnParallelLinear(64, [64, 64], bias=True, dtype=torch.bfloat16, kernels=cpu_path)
    w = [torch.randn(n, 64, generator=g).bfloat16() for n in (64, 64)]  # whole 64-wide blocks: no padding
    for i, wi in enumerate(w):
        col.load_part(i, wi)
        col.load_part(i, torch.randn(wi.shape[0], generator=g).bfloat16(), "bias")
    xs = [torch.randn(m, 64, generator=g).bfloat16() for m in (1, 5, 64)]
    want = [col(x).float() for x in xs]
    col.process_weights_after_loading()
    if onednn_bf16_view_expected():
        assert col.packed and col.gemv_weight is not None and col.gemv_weight.dtype == torch.bfloat16
    elif not onednn_packs_bf16():  # an AVX2-only host: torch refuses a bf16 reorder; F.linear runs
        assert not col.packed and col.gemv_weight is None and not col.weight.is_mkldnn
    for x, ref in zip(xs, want):
        got = col(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=2e-2)


@pytest.mark.skipif(not ONEDNN_LINEAR, reason="this torch build has no oneDNN packed linear")
def test_small_batches_take_the_c_gemv_and_agree(cpu_path, monkeypatch):
    g = torch.Generator().manual_seed(1)
    col = MergedColumnParallelLinear(48, [64, 64], bias=True, kernels=cpu_path)
    for i in range(2):
        col.load_part(i, torch.randn(64, 48, generator=g))
        col.load_part(i, torch.randn(64, generator=g), "bias")
    xs = [torch.randn(m, 48, generator=g) for m in (1, 3, 8, 9, 40)]
    want = [col(x) for x in xs]
    col.process_weights_after_loading()
    assert col.gemv_weight is not None and col.gemv_weight.shape == (2, 48, 64)  # layout verified
    calls = []
    if cpu_path is not None:
        real = cpu_path.gemv_packed
        monkeypatch.setattr(cpu_path, "gemv_packed", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for x, w in zip(xs, want):
        torch.testing.assert_close(col(x), w, atol=1e-5, rtol=1e-5)
    assert calls == ([1, 3, 8] if cpu_path is not None else [])  # C GEMV up to 8 rows, else oneDNN


@pytest.mark.skipif(not ONEDNN_LINEAR, reason="this torch build has no oneDNN packed linear")
def test_tied_lm_head_is_packed_once_and_the_embedding_reads_its_rows(cpu_path):
    g = torch.Generator().manual_seed(2)
    head = ParallelLMHead(192, 48, tied=True, kernels=cpu_path)
    emb = VocabParallelEmbedding(192, 48, tied_rows=head.embedding_rows)
    w = torch.randn(192, 48, generator=g)
    head.load(w)
    head.process_weights_after_loading()
    # packed when the embedding can read the packing (its layout checked against oneDNN)
    assert head.packed and head.gemv_weight is not None
    ids = torch.tensor([0, 5, 63, 64, 191, 5])
    assert torch.equal(emb(ids), w[ids])
    many = torch.randint(0, 192, (40,), generator=g)  # a prefill's worth: rows split across threads
    assert torch.equal(emb(many), w[many])
    with pytest.raises(IndexError if head.packed else RuntimeError):
        emb(torch.tensor([3, 192]))
    for m in (1, 3, 20):
        h = torch.randn(m, 48, generator=g)
        torch.testing.assert_close(head(h), h @ w.t(), atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="already packed") if head.packed else _nothing():
        head.load(w)


def _packed_bytes(packed: torch.Tensor) -> bytes:
    import ctypes

    n = torch.ops.mkldnn._nbytes(packed)
    return ctypes.string_at(torch.ops.mkldnn.data_ptr(packed), n)


@pytest.mark.skipif(not ONEDNN_LINEAR, reason="this torch build has no oneDNN packed linear")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_transposed_weight_packs_to_the_bytes_of_its_contiguous_copy(dtype):
    """The column-parallel layers hand their ``[in, out]`` storage to oneDNN as a ``[out, in]``
    view; the packing must be byte for byte the one of a contiguous copy."""
    from pkgd.runner.layers.linear import pack_for_onednn

    if dtype == torch.bfloat16 and not onednn_packs_bf16():
        pytest.skip("oneDNN does not pack bf16 weights on this CPU")
    w_in_out = torch.randn(576, 960, generator=torch.Generator().manual_seed(1)).to(dtype)
    strided, contiguous = pack_for_onednn(w_in_out.t()), pack_for_onednn(w_in_out.t().contiguous())
    assert strided is not None and contiguous is not None
    assert _packed_bytes(strided) == _packed_bytes(contiguous)


@pytest.mark.skipif(not ONEDNN_LINEAR, reason="this torch build has no oneDNN packed linear")
def test_the_packed_layout_is_checked_once_per_shape_and_not_decided_by_zeros(monkeypatch):
    from pkgd.runner.layers import linear as L

    monkeypatch.setattr(L, "_LAYOUTS", {})
    checks = []
    real = L._check_layouts
    monkeypatch.setattr(L, "_check_layouts", lambda *a: checks.append(a[-1]) or real(*a))
    g = torch.Generator().manual_seed(2)
    zeros = L.pack_for_onednn(torch.zeros(128, 48))
    assert L.packed_view(zeros, 128, 48) is not None and checks == [48]  # any candidate fits zeros
    views = []
    for _ in range(3):
        w = torch.randn(128, 48, generator=g)
        packed = L.pack_for_onednn(w)
        view = L.packed_view(packed, 128, 48)  # valid while packed lives
        assert view is not None
        torch.testing.assert_close(view.permute(0, 2, 1).reshape(128, 48), w, rtol=0, atol=0)  # [n/64, k, 64]
        views.append(packed)
    assert checks == [48, 48]  # the zero weight decided nothing; the first random one did
    assert L.packed_view(L.pack_for_onednn(torch.randn(64, 48, generator=g)), 64, 48) is not None
    assert checks == [48, 48, 48]  # another shape is checked on its own

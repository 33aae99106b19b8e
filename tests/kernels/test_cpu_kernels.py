"""``pkgd_kernels.cpu``: the C forms of the ops, built by the host compiler, against the ops'
PyTorch references; how the build behaves (cached, atomic, a clear reason when it cannot
happen); and the ABI check at load."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from tests.runner.factory import onednn_bf16_view_expected

import pkgd_kernels as pk
from pkgd_kernels import cpu
from pkgd_kernels.attention import paged_attention_decode_ref
from pkgd_kernels.cpu import build


def _build(cache_dir):
    return build.build(cpu.KERNELS, cache_dir)


ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@pytest.fixture(scope="module")
def kernels():
    try:
        return cpu.load()
    except cpu.CpuKernelsUnavailable as e:
        pytest.skip(f"C kernels unavailable here: {e}")


@pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN packed linear")
@pytest.mark.parametrize("n,k", [(64, 48), (192, 576), (128, 1536)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_reads_the_onednn_packing(kernels, n, k, m, bias):
    from pkgd.runner.layers.linear import packed_view

    g = torch.Generator().manual_seed(n + k + m)
    w = torch.randn(n, k, generator=g)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    view = packed_view(packed, n, k)
    assert view is not None  # oneDNN's fp32 packing here is [N/64][K][64]
    x = torch.randn(m, k + 8, generator=g)[:, :k]  # rows with a stride: a view, not a copy
    b = torch.randn(n, generator=g) if bias else None
    y = kernels.gemv_packed(x, view, b)
    torch.testing.assert_close(y, pk.gemv_packed_ref(x, view, b), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(y, x @ w.t() + (b if bias else 0), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pk.gemv_packed(x, view, b, kernels=kernels), y)


@pytest.mark.parametrize("t", [1, 5, 40])  # 40: rows split across threads
def test_gather_matches_the_reference(kernels, t):
    g = torch.Generator().manual_seed(t)
    w = torch.randn(4, 48, 64, generator=g)
    ids = torch.randint(0, 256, (t,), generator=g)
    torch.testing.assert_close(kernels.gather_packed(w, ids), pk.gather_packed_ref(w, ids), atol=0, rtol=0)
    with pytest.raises(IndexError):
        kernels.gather_packed(w, torch.tensor([3, 256]))


def test_gemv_refuses_what_it_cannot_read(kernels):
    with pytest.raises(ValueError, match="float32"):
        kernels.gemv_packed(torch.randn(1, 8), torch.zeros(1, 8, 32), None)
    with pytest.raises(ValueError, match="float32"):
        kernels.gemv_packed(torch.randn(1, 8, dtype=torch.float64), torch.zeros(1, 8, 64), None)


def _paged(num_seqs, hkv, d, bs, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 71, (num_seqs,), generator=g, dtype=torch.int32)
    lens[0] = 1
    per_seq = -(-70 // bs)
    num_blocks = num_seqs * per_seq + 3
    kc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: num_seqs * per_seq].view(num_seqs, per_seq).to(torch.int32)
    return kc, vc, tables, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 16), (9, 3, 64), (4, 4, 32), (16, 2, 128)])
@pytest.mark.parametrize("num_seqs", [1, 3, 40])  # 40: work split by sequence, else by KV head
@pytest.mark.parametrize("bs", [1, 16, 32])  # 32: two groups of 16 keys per block
def test_decode_attention_matches_the_reference(kernels, dtype, hq, hkv, d, num_seqs, bs):
    kc, vc, tables, lens = _paged(num_seqs, hkv, d, bs, dtype, seed=hq * d + num_seqs + bs)
    # queries as the model hands them over: the Q part of a [T, Hq + Hkv, D] rotary output
    q = torch.randn(num_seqs, hq + hkv, d)[:, :hq]
    out = kernels.paged_attention_decode(q, kc, vc, tables, lens, d**-0.5)
    want = paged_attention_decode_ref(q.contiguous(), kc.float(), vc.float(), tables, lens, d**-0.5)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pk.paged_attention_decode(q, kc, vc, tables, lens, d**-0.5, kernels=kernels), out)


def test_decode_attention_is_exact_softmax_for_long_contexts(kernels):
    # one sequence of 3000 tokens: the score buffer and the vectorised exp over a long row
    kc, vc, tables, _ = _paged(1, 2, 64, 16, torch.float32, seed=7)
    kc = torch.randn(200, 16, 2, 64)
    vc = torch.randn(200, 16, 2, 64)
    tables = torch.randperm(200)[:188].view(1, -1).to(torch.int32)
    lens = torch.tensor([3000], dtype=torch.int32)
    q = 3 * torch.randn(1, 8, 64)  # large scores: the max subtraction matters
    out = kernels.paged_attention_decode(q, kc, vc, tables, lens, 0.125)
    want = paged_attention_decode_ref(q, kc, vc, tables, lens, 0.125)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_takes_says_no_to_layouts_the_kernel_does_not_take():
    takes = cpu.CpuKernels.takes_paged_attention_decode
    kc = torch.zeros(4, 16, 2, 64)
    assert takes(torch.zeros(3, 4, 64), kc)
    assert takes(torch.zeros(3, 4, 64, dtype=torch.bfloat16), kc)  # bf16 queries: widened
    assert not takes(torch.zeros(3, 4, 64, dtype=torch.float64), kc)
    assert not takes(torch.zeros(3, 4, 24), torch.zeros(4, 16, 2, 24))  # D % 16
    assert not takes(torch.zeros(3, 3, 64), kc)  # Hq % Hkv
    assert not takes(torch.zeros(3, 64, 4).transpose(1, 2), kc)  # heads strided
    assert not cpu.CpuKernels.takes_rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(8))
    assert cpu.CpuKernels.takes_rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(8).bfloat16())
    assert not cpu.CpuKernels.takes_rms_norm(torch.zeros(2, 8).half(), torch.ones(8).half())
    assert cpu.CpuKernels.takes_silu_and_mul(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert not cpu.CpuKernels.takes_silu_and_mul(torch.zeros(2, 7))  # odd width
    assert not cpu.CpuKernels.takes_silu_and_mul(torch.zeros(8, 2).t())  # columns strided
    assert not cpu.CpuKernels.takes_silu_and_mul(torch.zeros(2, 3, 8))
    takes_rope = cpu.CpuKernels.takes_rotary_embedding
    q, table = torch.zeros(2, 128, dtype=torch.bfloat16), torch.zeros(8, 64)
    assert takes_rope(q, q, table)
    assert not takes_rope(q, q.float(), table)  # one dtype
    assert not takes_rope(q.half(), q.half(), table)
    assert not takes_rope(q, q, table.bfloat16())
    assert not takes_rope(torch.zeros(2, 1024), torch.zeros(2, 1024), torch.zeros(8, 1024))  # rot > 512
    assert not takes_rope(torch.zeros(128, 2, dtype=torch.bfloat16).t(), q, table)
    assert not cpu.CpuKernels.takes_gemv_packed(torch.zeros(2, 8), torch.zeros(1, 8, 64).transpose(0, 1))


def test_kernels_use_torchs_thread_count(kernels):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert kernels.num_threads() == 1
        torch.set_num_threads(2)
        assert kernels.num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_build_is_cached_per_source_and_leaves_no_partial_files(tmp_path):
    try:
        first = _build(tmp_path)
    except cpu.CpuKernelsUnavailable as e:
        pytest.skip(str(e))
    stamp = first.stat().st_mtime_ns
    assert _build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, first.name + ".sha256"]  # no .build-* left


def test_no_compiler_is_a_clear_reason_unless_the_library_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(cpu.CpuKernelsUnavailable, match="no C compiler"):
        _build(tmp_path / "empty")
    monkeypatch.delenv("CC")
    try:
        built = _build(tmp_path / "filled")
    except cpu.CpuKernelsUnavailable as e:
        pytest.skip(str(e))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert _build(tmp_path / "filled") == built  # filled in advance: no compiler needed


def test_cc_with_arguments_damaged_cache_and_old_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "gcc -Wall")  # a command with arguments, like "ccache gcc"
    (tmp_path / "cpu-kernels-0123456789abcdef.so").write_bytes(b"an earlier source's build")
    try:
        path = _build(tmp_path)
    except cpu.CpuKernelsUnavailable as e:
        pytest.skip(str(e))
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".sha256"]  # the earlier build is gone
    path.write_bytes(b"truncated")  # damaged: rebuilt once on load
    lib, _ = build.open_library.__wrapped__(cpu.KERNELS, tmp_path)
    assert lib.pkgd_abi_version() == cpu.KERNELS.abi_version and path.stat().st_size > 1000


@pytest.mark.parametrize("damage", ["cut-short", "no-digest"])
def test_a_cut_short_library_is_rebuilt_not_loaded(tmp_path, damage):
    """A library cut off mid-file (an interrupted copy of a prefilled cache) killed the loading
    process with SIGBUS inside dlopen; it must be caught by its digest and rebuilt. Loaded in a
    child process, so a regression fails this test instead of crashing the run."""
    try:
        path = _build(tmp_path)
    except cpu.CpuKernelsUnavailable as e:
        pytest.skip(str(e))
    whole = path.read_bytes()
    if damage == "cut-short":
        path.write_bytes(whole[: len(whole) // 3])
    else:
        (tmp_path / (path.name + ".sha256")).unlink()
    code = (
        "import sys; from pathlib import Path; from pkgd_kernels import cpu; "
        "print(cpu.load(Path(sys.argv[1])).num_threads())"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert path.read_bytes() == whole or len(path.read_bytes()) > len(whole) // 2


def test_the_library_is_built_in_the_callers_directory(tmp_path):
    try:
        kernels = cpu.load(tmp_path / "k")
    except cpu.CpuKernelsUnavailable as e:
        pytest.skip(str(e))
    assert kernels.path.parent == tmp_path / "k"


def test_a_failed_build_says_why_and_writes_nothing(tmp_path, monkeypatch):
    script = tmp_path / "cc"
    script.write_text(
        '#!/bin/sh\nif [ "$1" = --version ]; then echo fakecc 1.0; exit 0; fi\n'
        "echo 'kernels.c:1: error: nope' >&2\nexit 1\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))
    out = tmp_path / "cache"
    with pytest.raises(cpu.CpuKernelsUnavailable, match="error: nope"):
        _build(out)
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("t,h", [(1, 576), (3, 40), (300, 256)])  # 300 x 256: the threaded path
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_reference(kernels, t, h, with_residual, dtype):
    g = torch.Generator().manual_seed(t + h)
    x = (3 * torch.randn(t, h + 5, generator=g)).to(dtype)[:, :h]  # strided rows
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    res = torch.randn(t, h, generator=g).to(dtype) if with_residual else None
    if with_residual:
        out, res_out = pk.fused_add_rms_norm(x, res, w, 1e-5, kernels=kernels)
        want, want_res = pk.fused_add_rms_norm_ref(x, res, w, 1e-5)
        assert res_out.dtype == dtype and torch.equal(res_out, want_res)
    else:
        out, want = pk.rms_norm(x, w, 1e-5, kernels=kernels), pk.rms_norm_ref(x, w, 1e-5)
    assert out.dtype == dtype
    if dtype == torch.bfloat16:
        # the reference's roundings, in its order: the same bf16 values (a differently
        # ordered sum of squares could move a value by one ulp; none does here)
        assert torch.equal(out, want)
    else:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="float32"):
        kernels.rms_norm(x.double(), w.double(), 1e-5)
    with pytest.raises(ValueError, match="residual like x"):
        kernels.fused_add_rms_norm(x, torch.zeros(t, h, dtype=torch.float16), w, 1e-5)


@pytest.mark.parametrize("t,i", [(1, 1536), (5, 40), (64, 1536)])  # 64 x 1536: the threaded path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_the_reference(kernels, t, i, dtype):
    g = torch.Generator().manual_seed(t + i)
    x = (4 * torch.randn(t, 2 * i + 3, generator=g)).to(dtype)[:, : 2 * i]  # strided rows
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's range ends, both zeros
    x[0, i : i + 4] = 1.5
    out = pk.silu_and_mul(x, kernels=kernels)
    want = pk.silu_and_mul_ref(x)
    assert out.dtype == dtype and out.shape == (t, i)
    if dtype == torch.bfloat16:
        # silu's value rounded to bf16 before the product, as the reference's two ops: equal
        # but for an ulp where the exps differ in their last float32 bit
        torch.testing.assert_close(out, want, atol=1e-30, rtol=2**-7)
        assert (out != want).float().mean() < 1e-3
    else:
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    assert out[0, :4].tolist() == pytest.approx([-0.0, 150.0, 0.0, 0.0], abs=1e-30)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernels.silu_and_mul(x.half())


def _rope_table(max_pos: int, rot: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    f = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat((f.cos(), f.sin()), dim=-1)


# rot 64 and 32: 16 channels at a time; 40: one pair at a time; rot < d: channels copied
@pytest.mark.parametrize("d,rot", [(64, 64), (64, 32), (64, 40)])
@pytest.mark.parametrize("is_neox", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [3, 300])  # 300: the threaded path
def test_rotary_embedding_matches_the_reference(kernels, d, rot, is_neox, dtype, t):
    g = torch.Generator().manual_seed(d + rot + t)
    qkv = torch.randn(t, 13 * d, generator=g).to(dtype)
    q, k = qkv[:, : 9 * d], qkv[:, 9 * d : 12 * d]  # views into a fused QKV row, as the model's
    pos = torch.randint(0, 2048, (t,), generator=g)
    table = _rope_table(2048, rot)
    out = pk.rotary_embedding(pos, q, k, d, table, is_neox, kernels=kernels)
    want = pk.rotary_embedding_ref(pos, q, k, d, table, is_neox)
    for o, w in zip(out, want):
        assert o.dtype == dtype and o.shape == w.shape
        if dtype == torch.bfloat16:  # rounded once from float32 sums that may differ by an ulp
            torch.testing.assert_close(o, w, atol=0, rtol=2**-7)
            assert (o != w).float().mean() < 1e-3
        else:
            torch.testing.assert_close(o, w, atol=1e-6, rtol=1e-6)
        assert torch.equal(o.view(t, -1, d)[..., rot:], w.view(t, -1, d)[..., rot:])
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 2048\), got 2048"):
        kernels.rotary_embedding(torch.tensor([0, 2048] + [0] * (t - 2)), q, k, d, table, is_neox)
    with pytest.raises(ValueError, match="float32 table"):
        kernels.rotary_embedding(pos, q, k, d, table.double(), is_neox)


def test_a_library_of_another_abi_is_rebuilt_and_one_that_disagrees_is_refused(tmp_path):
    """The loader asks the library for its ABI version and struct layouts: a stale library in
    the cache (another version) is built again; one whose struct layout disagrees with the
    ctypes binding even when fresh is refused with both layouts in the message."""
    import ctypes
    import dataclasses

    try:
        path = _build(tmp_path)
    except cpu.CpuKernelsUnavailable as e:
        pytest.skip(str(e))
    stale = dataclasses.replace(cpu.KERNELS, abi_version=cpu.KERNELS.abi_version + 1)
    with pytest.raises(
        cpu.CpuKernelsUnavailable,
        match=rf"has ABI {cpu.KERNELS.abi_version}, its bindings expect {cpu.KERNELS.abi_version + 1}",
    ):
        build.open_library.__wrapped__(stale, tmp_path)
    assert path.exists()  # the wrong one was removed and built again (then still refused)

    class Unknown(ctypes.Structure):
        _c_name_ = "no_such_struct"
        _fields_ = [("a", ctypes.c_int64)]

    with pytest.raises(cpu.CpuKernelsUnavailable, match=r"struct no_such_struct is .* unknown in C but \[8, 0\]"):
        build.open_library.__wrapped__(dataclasses.replace(cpu.KERNELS, structs=(Unknown,)), tmp_path)
    assert build.struct_layout(Unknown) == [8, 0]


def _bf16_impls(kernels):
    return ["widen"] + (["dpbf16"] if kernels.bf16_native else [])


@pytest.fixture
def bf16_impl(kernels, request):
    """Run with each bf16 dot product this CPU can execute; restores the handle's choice."""
    before = kernels.bf16_impl
    yield kernels
    kernels.use_bf16_impl(before)


def _pack_bf16(w, block):
    """``W [n, k]`` in the ``[n/B, k/2, B, 2]`` packing, built by hand (as oneDNN lays it out)."""
    n, k = w.shape
    return w.view(n // block, block, k // 2, 2).permute(0, 2, 1, 3).contiguous()


@pytest.mark.parametrize("block", [32, 64])
@pytest.mark.parametrize("n,k", [(128, 64), (960, 576), (576, 1536)])
@pytest.mark.parametrize("m", [1, 3, 4, 8])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_bf16_gemv_reads_each_block_width_by_each_path(bf16_impl, block, n, k, m, x_dtype):
    kernels = bf16_impl
    g = torch.Generator().manual_seed(n + k + m + block)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    view = _pack_bf16(w, block)
    x = torch.randn(m, k + 6, generator=g)[:, :k].to(x_dtype)
    b = torch.randn(n, generator=g)
    want = pk.gemv_packed_ref(x, view, b)
    dense = (x.to(torch.bfloat16).float() @ w.float().t() + b).to(x_dtype)
    rounded = 1e-3 if x_dtype == torch.float32 else 1e-2  # a bf16 result: one ulp apart at most
    torch.testing.assert_close(want.float(), dense.float(), atol=rounded, rtol=rounded)
    for impl in _bf16_impls(kernels):
        kernels.use_bf16_impl(impl)
        out = kernels.gemv_packed(x, view, b)
        assert out.dtype == x_dtype
        tol = 1e-4 * k**0.5 if x_dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    ids = torch.randint(0, n, (9,), generator=g)
    assert torch.equal(kernels.gather_packed(view, ids), w[ids]) and torch.equal(
        pk.gather_packed_ref(view, ids), w[ids]
    )


def test_bf16_packing_of_another_block_width_is_refused(kernels):
    view = torch.zeros(2, 4, 16, 2, dtype=torch.bfloat16)
    assert not kernels.takes_gemv_packed(torch.zeros(1, 8), view)
    with pytest.raises(ValueError, match="B 32 or 64"):
        pk.gemv_packed_ref(torch.zeros(1, 8), view, None)


@pytest.mark.skipif(
    not ONEDNN or not onednn_bf16_view_expected(),
    reason="oneDNN packs bf16 in a layout the C GEMV reads only on AVX512-BF16 / AMX hosts",
)
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (49152 // 64, 576)])
def test_onednn_bf16_packing_is_read_as_a_view_here(kernels, n, k):
    """oneDNN's bf16 packing of these shapes (SmolLM2's, whole blocks) is one the C GEMV reads on
    this CPU, whatever block width oneDNN chose; the kernel agrees with oneDNN's own product."""
    from pkgd.runner.layers.linear import onednn_linear, packed_view

    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    view = packed_view(packed, n, k)
    assert view is not None and view.shape[2:] in cpu.BF16_BLOCKS
    assert view.shape == (n // view.shape[2], k // 2, view.shape[2], 2)
    x = torch.randn(4, k, generator=g).to(torch.bfloat16)
    ours, theirs = kernels.gemv_packed(x, view, None).float(), onednn_linear(x, packed, None).float()
    torch.testing.assert_close(ours, theirs, atol=2e-2 * theirs.abs().max().item(), rtol=2e-2)


def test_the_bf16_path_is_chosen_by_the_cpu_and_a_missing_one_refused(kernels):
    assert kernels.bf16_impl == ("dpbf16" if kernels.bf16_native else "widen")
    if not kernels.bf16_native:
        with pytest.raises(ValueError, match="not available here"):
            kernels.use_bf16_impl("dpbf16")
    with pytest.raises(ValueError, match="not available here"):
        kernels.use_bf16_impl("amx")


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_seqs", [5, 40])  # 40: work split by sequence, else by KV head
def test_decode_attention_takes_16_bit_queries(kernels, q_dtype, num_seqs):
    """16-bit queries (strided, as the rotary output hands them over) are widened in the kernel
    and the result is the float32 computation rounded once: bit-equal to the float32 query's
    (by widening; vdpbf16ps sums in another order, next test)."""
    kc, vc, tables, lens = _paged(num_seqs, 2, 64, 16, q_dtype, seed=3)
    q = torch.randn(num_seqs, 10, 64).to(q_dtype)[:, :8]
    before = kernels.bf16_impl
    kernels.use_bf16_impl("widen")
    try:
        out = kernels.paged_attention_decode(q, kc, vc, tables, lens, 0.125)
    finally:
        kernels.use_bf16_impl(before)
    assert out.dtype == q_dtype and out.is_contiguous()
    wide = kernels.paged_attention_decode(q.float(), kc, vc, tables, lens, 0.125)
    torch.testing.assert_close(out, wide.to(q_dtype), atol=0, rtol=0)
    want = paged_attention_decode_ref(q.float(), kc.float(), vc.float(), tables, lens, 0.125)
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("hq,hkv,d", [(3, 3, 64), (4, 2, 64), (9, 3, 64), (10, 2, 128), (16, 2, 128), (8, 2, 32)])
@pytest.mark.parametrize("num_seqs", [3, 40])
def test_bf16_decode_attention_by_each_dot_product(bf16_impl, hq, hkv, d, num_seqs):
    """bf16 queries over a bf16 cache, by each path this CPU runs (scores by vdpbf16ps where it
    has it; the values of up to four query heads per cached row, GQA groups of 1-8): the float32
    reference of the same bf16 values, rounded once; the two paths within a bf16 rounding."""
    kernels = bf16_impl
    kc, vc, tables, lens = _paged(num_seqs, hkv, d, 16, torch.bfloat16, seed=hq + d + num_seqs)
    q = torch.randn(num_seqs, hq + hkv, d).to(torch.bfloat16)[:, :hq]
    want = paged_attention_decode_ref(q.float().contiguous(), kc.float(), vc.float(), tables, lens, d**-0.5)
    outs = []
    for impl in _bf16_impls(kernels):
        kernels.use_bf16_impl(impl)
        out = kernels.paged_attention_decode(q, kc, vc, tables, lens, d**-0.5)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)
        outs.append(out.float())
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], atol=8e-3, rtol=8e-3)  # one bf16 ulp: 2^-7 relative

"""GGUF quantized weights kept quantized: the packed layout against the gguf package's own
dequantization (the oracle), the int8 activations and ``quant_linear`` / ``quant_gather`` of
every C path this CPU runs against their PyTorch references.

Bounds: packing and dequantizing are exact (the same float32 operations as ``gguf.quants``);
the C activations are bit-identical to the reference's. ``quant_linear``'s C form computes the
reference's sum ``sum_k xhat_k w_k`` with exact integer block sums and float32 block scales, so
the two differ only in the order of float32 additions: by Higham's bound for recursive sums at
most ``(K + 2 * blocks) * eps32 * sum_k |xhat_k w_k|`` per output.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.runner.tiny_gguf import quantize_blocks

import pkgd_kernels as pk
from pkgd_kernels import cpu
from pkgd_kernels.quant import dequantized_activations, quantize_activations
from pkgd_kernels.quant_layout import BLOCK, GGUF_BLOCK_BYTES, QTYPES, dequantize, pack_gguf_rows, packed_segments

TYPES = list(QTYPES)
EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def kernels():
    try:
        k = cpu.load()
        k.quant  # noqa: B018 - builds the quantized library
        return k
    except cpu.CpuKernelsUnavailable as e:
        pytest.skip(f"C kernels unavailable here: {e}")


def _raw(qtype: str, n: int, k: int, seed: int, kind: str = "quantized") -> np.ndarray:
    """GGUF block rows: a random matrix quantized, or random bytes with sane fp16 scales (every
    bit pattern of the quants and sub-scales)."""
    rng = np.random.default_rng(seed)
    if kind == "quantized":
        return quantize_blocks((rng.standard_normal((n, k)) * 0.5).astype(np.float32), qtype)
    qt = QTYPES[qtype]
    nb = k // BLOCK[qt]
    b = rng.integers(0, 256, (n, nb, GGUF_BLOCK_BYTES[qt]), dtype=np.uint8)

    def scale():
        return (rng.standard_normal((n, nb)) * 0.02).astype(np.float16).view(np.uint8).reshape(n, nb, 2)

    offsets = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}[qtype]
    for o in offsets:
        b[..., o : o + 2] = scale()
    return b.reshape(n, -1)


def _gguf_dequant(raw: np.ndarray, qtype: str) -> torch.Tensor:
    import gguf

    return torch.from_numpy(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype)).astype(np.float32))


def _weight(parts, k):
    return pack_gguf_rows([(QTYPES[t], torch.from_numpy(r)) for t, r in parts], k)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("kind", ["quantized", "random"])
def test_packing_keeps_the_gguf_values_bit_for_bit(qtype, kind):
    k = 512
    raw = _raw(qtype, 48, k, seed=1, kind=kind)
    w = _weight([(qtype, raw)], k)
    assert torch.equal(dequantize(w), _gguf_dequant(raw, qtype))
    bits = {"Q4_0": 5.0, "Q4_1": 5.0, "Q8_0": 9.0, "Q4_K": 4.625, "Q6_K": 6.625}[qtype]
    assert w.nbytes == 48 * k * bits / 8  # the file's size, to within the scales' padding


def test_segments_of_several_types_and_padding_rows():
    k = 256
    parts = [
        ("Q4_1", _raw("Q4_1", 32, k, 2)),
        ("Q4_1", _raw("Q4_1", 16, k, 3)),
        ("Q6_K", _raw("Q6_K", 16, k, 4)),
        ("Q8_0", _raw("Q8_0", 7, k, 5)),
    ]
    w = _weight(parts, k)
    assert [s.qtype for s in w.segments] == [QTYPES[t] for t in ("Q4_1", "Q6_K", "Q8_0")]  # same-type parts merged
    assert (w.n, w.rows) == (71, 80)
    assert packed_segments([(QTYPES[t], r.shape[0]) for t, r in parts], k) == w.segments  # what a stored copy must hold
    assert sum(s.nbytes for s in w.segments) == w.nbytes
    want = torch.cat([_gguf_dequant(r, t) for t, r in parts])
    assert torch.equal(dequantize(w), want)
    with pytest.raises(ValueError, match="multiple of 16"):
        _weight([("Q8_0", _raw("Q8_0", 7, k, 5)), ("Q4_1", _raw("Q4_1", 16, k, 3))], k)
    with pytest.raises(ValueError, match="not one the quantized kernels read"):
        pack_gguf_rows([(QTYPES["Q4_K"], torch.from_numpy(_raw("Q4_1", 16, 96, 1)))], 96)


@pytest.mark.parametrize("block", [32, 256])
def test_c_activations_are_the_references_bit_for_bit(kernels, block):
    g = torch.Generator().manual_seed(block)
    x = torch.randn(5, 768, generator=g) * torch.logspace(-3, 2, 768)
    x[2, :256] = 0.0  # an all-zero block: scale 0, quants 0
    q, d = kernels.quant.quantize_activations(x, block)
    q_ref, d_ref = quantize_activations(x, block)
    assert torch.equal(q, q_ref) and torch.equal(d, d_ref)
    # rounding moves each input by at most half a step of its block
    err = (dequantized_activations(x, block) - x).abs().reshape(5, -1, block)
    assert (err <= d_ref.unsqueeze(-1) / 2 * (1 + 1e-6)).all()


def _bound(x, w, k_blocks):
    terms = dequantized_activations(x, BLOCK[w.segments[0].qtype]).abs() @ dequantize(w).abs().t()
    return (w.k + 2 * k_blocks) * EPS * terms + 1e-6


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 11])
def test_quant_linear_every_path_matches_the_reference(kernels, qtype, m):
    k, n = 768, 64
    w = _weight([(qtype, _raw(qtype, n, k, seed=m, kind="random" if m % 2 else "quantized"))], k)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k + 5, generator=g)[:, :k]  # rows with a stride
    bias = torch.randn(n, generator=g)
    ref = pk.quant_linear_ref(x, w, bias)
    bound = _bound(x, w, k // BLOCK[QTYPES[qtype]])
    impl = kernels.quant.impl
    try:
        for path in kernels.quant.available_impls():
            kernels.quant.use_impl(path)
            y = pk.quant_linear(x, w, bias, kernels=kernels)
            assert ((y - ref).abs() <= bound).all(), (path, float((y - ref).abs().max()))
    finally:
        kernels.quant.use_impl(impl)


def test_quant_linear_over_mixed_segments_and_padding(kernels):
    k = 512
    parts = [("Q4_K", _raw("Q4_K", 32, k, 6)), ("Q6_K", _raw("Q6_K", 16, k, 7)), ("Q8_0", _raw("Q8_0", 21, k, 8))]
    w = _weight(parts, k)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(9))
    y = kernels.quant_linear(x, w, None)
    assert y.shape == (6, 69)
    ref = pk.quant_linear_ref(x, w, None)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-5)
    # the reference's definition: int8 activations of each segment's block size, float weights
    row = 0
    for (t, r), seg in zip(parts, w.segments):
        want = dequantized_activations(x, BLOCK[seg.qtype]) @ _gguf_dequant(r, t).t()
        torch.testing.assert_close(ref[:, row : row + r.shape[0]], want, atol=1e-5, rtol=1e-5)
        row += r.shape[0]


def test_quant_linear_against_the_float_product_within_activation_rounding(kernels):
    """Against ``x @ W^T`` on the float input, the difference is the activation rounding:
    at most ``sum_k |w_k| dx_k / 2``."""
    k = 576
    raw = _raw("Q4_1", 64, k, 10)
    w = _weight([("Q4_1", raw)], k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(10))
    wf = _gguf_dequant(raw, "Q4_1")
    _, dx = quantize_activations(x, 32)
    step = dx.repeat_interleave(32, dim=1) / 2
    assert ((kernels.quant_linear(x, w, None) - x @ wf.t()).abs() <= step @ wf.abs().t() * 1.001 + 1e-4).all()


@pytest.mark.parametrize("qtype", TYPES)
def test_quant_gather_is_the_dequantized_rows(kernels, qtype):
    k = 512
    raw = _raw(qtype, 40, k, 11, kind="random")
    w = _weight([(qtype, raw)], k)
    ids = torch.tensor([0, 39, 17, 17, 5])
    rows = pk.quant_gather(w, ids, kernels=kernels)
    torch.testing.assert_close(rows, _gguf_dequant(raw, qtype)[ids], atol=0, rtol=0)
    assert torch.equal(pk.quant_gather_ref(w, ids), rows)
    for bad in ([40], [-1]):
        with pytest.raises(IndexError):
            pk.quant_gather(w, torch.tensor(bad), kernels=kernels)
        with pytest.raises(IndexError):
            pk.quant_gather_ref(w, torch.tensor(bad))


def test_bad_inputs_are_clear_errors(kernels):
    w = _weight([("Q8_0", _raw("Q8_0", 16, 64, 12))], 64)
    with pytest.raises(ValueError, match="quant_linear.*x"):
        pk.quant_linear(torch.randn(2, 32), w, None, kernels=kernels)
    with pytest.raises(ValueError, match="QuantWeight"):
        pk.quant_linear(torch.randn(2, 64), torch.randn(16, 64), None)
    with pytest.raises(ValueError, match="bias"):
        pk.quant_linear(torch.randn(2, 64), w, torch.randn(3), kernels=kernels)
    with pytest.raises(ValueError, match="int64"):
        pk.quant_gather(w, torch.tensor([1], dtype=torch.int32), kernels=kernels)


def test_the_best_path_is_chosen_and_unavailable_ones_refused(kernels):
    q = kernels.quant
    flags = set()
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.partition(":")[2].split())
                break
    want = (
        "vnni512"
        if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags
        else "avx2"
        if {"avx2", "fma", "f16c"} <= flags
        else "scalar"
    )
    if flags:
        assert q.best_impl == want
    assert q.available_impls()[0] == "scalar" and q.available_impls()[-1] == q.best_impl
    with pytest.raises(ValueError, match="not one this CPU runs"):
        q.use_impl("avx1024")

"""rms_norm / fused_add_rms_norm: reference vs torch's own RMSNorm, Triton (interpreted) vs
reference. Tolerances: float32 atol 1e-6 / rtol 1e-5 (summation order); float16 one ulp
(rtol 2**-10; the kernel's 1/sqrt may round differently from torch.rsqrt); bfloat16 two ulps
(rtol 2**-6), because Triton's interpreter truncates float32 -> bfloat16 where GPUs and torch
round to nearest even."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pkgd_kernels import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm,
    rms_norm_ref,
    rms_norm_triton,
)

FP32 = dict(atol=1e-6, rtol=1e-5)
FP16 = dict(atol=1e-5, rtol=2**-10)
BF16 = dict(atol=1e-5, rtol=2**-6)


def _x(generator, *shape, dtype=torch.float32):
    return (torch.randn(shape, generator=generator) * 3).to(dtype)


def test_reference_matches_torch_rms_norm(generator):
    x, weight = _x(generator, 7, 48), _x(generator, 48)
    want = F.rms_norm(x.double(), (48,), weight.double(), eps=1e-6)
    torch.testing.assert_close(rms_norm_ref(x, weight, 1e-6), want.float(), **FP32)
    residual = _x(generator, 7, 48)
    out, new_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, x + residual)
    want = F.rms_norm((x + residual).double(), (48,), weight.double(), eps=1e-6)
    torch.testing.assert_close(out, want.float(), **FP32)


def test_reference_rounds_like_hugging_face_in_bf16(generator):
    """HF's LlamaRMSNorm: normalise in fp32, round to the input dtype, then scale."""
    x, weight = _x(generator, 4, 32, dtype=torch.bfloat16), _x(generator, 32, dtype=torch.bfloat16)
    x32 = x.float()
    want = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    out = rms_norm_ref(x, weight, 1e-5)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)


@pytest.mark.parametrize(
    "shape,block",
    [((3, 8), 8), ((5, 37), 64), ((4, 40), 16), ((2, 3, 24), 8), ((1, 1), 1)],
)
def test_triton_matches_reference(triton_interpreter, generator, shape, block):
    from pkgd_kernels import norm_triton

    x, residual, weight = _x(generator, *shape), _x(generator, *shape), _x(generator, shape[-1])
    rows, res_rows = x.reshape(-1, shape[-1]), residual.reshape(-1, shape[-1])
    out, new_res = torch.empty_like(rows), torch.empty_like(rows)
    norm_triton.launch_rms_norm(rows, None, weight, out, None, 1e-6, block=block)
    torch.testing.assert_close(out.view(shape), rms_norm_ref(x, weight, 1e-6), **FP32)
    norm_triton.launch_rms_norm(rows, res_rows, weight, out, new_res, 1e-6, block=block)
    want_out, want_res = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(new_res.view(shape), want_res)
    torch.testing.assert_close(out.view(shape), want_out, **FP32)


def test_triton_public_functions_on_strided_rows(triton_interpreter, generator):
    wide = _x(generator, 6, 80)
    x, residual, weight = wide[:, 8:72], _x(generator, 6, 64), _x(generator, 64)  # row stride 80
    want = rms_norm_ref(x, weight, 1e-5)
    torch.testing.assert_close(rms_norm_triton(x, weight, 1e-5), want, **FP32)
    got = fused_add_rms_norm_triton(x, residual, weight, 1e-5)
    want = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    torch.testing.assert_close(got, want, **FP32)
    assert rms_norm_triton(x[:0], weight, 1e-5).shape == (0, 64)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, FP16), (torch.bfloat16, BF16)])
def test_triton_half_precision(triton_interpreter, generator, dtype, tol):
    x, residual = _x(generator, 3, 96, dtype=dtype), _x(generator, 3, 96, dtype=dtype)
    weight = _x(generator, 96, dtype=dtype)
    got = fused_add_rms_norm_triton(x, residual, weight, 1e-6)
    want = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert got[0].dtype == got[1].dtype == dtype
    torch.testing.assert_close(got, want, **tol)


def test_dispatchers_on_cpu_run_the_reference(generator):
    x, residual, weight = _x(generator, 2, 16), _x(generator, 2, 16), _x(generator, 16)
    assert torch.equal(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
    got = fused_add_rms_norm(x, residual, weight, 1e-6)
    want = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("op", [rms_norm_ref, rms_norm_triton])
@pytest.mark.parametrize(
    "x_shape,w_shape,w_dtype,eps,message",
    [
        ((2, 8), (7,), torch.float32, 1e-6, "weight must have shape"),
        ((2, 8), (8,), torch.float16, 1e-6, "weight is torch.float16"),
        ((2, 8), (8,), torch.float32, -1.0, "eps must be >= 0"),
        ((2, 0), (0,), torch.float32, 1e-6, "H > 0"),
    ],
)
def test_bad_inputs_raise(generator, op, x_shape, w_shape, w_dtype, eps, message):
    with pytest.raises(ValueError, match=message):
        op(torch.zeros(x_shape), torch.ones(w_shape, dtype=w_dtype), eps)


@pytest.mark.parametrize("op", [fused_add_rms_norm_ref, fused_add_rms_norm_triton])
def test_fused_rejects_mismatched_residual(op):
    with pytest.raises(ValueError, match="residual must have shape"):
        op(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="residual is torch.bfloat16"):
        op(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6)

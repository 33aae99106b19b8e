"""silu_and_mul: reference vs the formula, Triton (interpreted) vs reference. Tolerance: float32
atol/rtol 1e-6 (the kernel's sigmoid vs torch's silu); bfloat16 two ulps (rtol 2**-6: the
kernel rounds once from float32, and Triton's interpreter truncates that rounding)."""

from __future__ import annotations

import pytest
import torch

from pkgd_kernels import (
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_ref,
    gelu_tanh_and_mul_triton,
    silu_and_mul,
    silu_and_mul_ref,
    silu_and_mul_triton,
)


def test_reference_matches_formula(generator):
    x = torch.randn(5, 2 * 12, generator=generator, dtype=torch.float64)
    gate, up = x[:, :12], x[:, 12:]
    want = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul_ref(x.float()), want.float(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape,block", [((3, 16), 8), ((4, 2 * 37), 16), ((2, 3, 2 * 5), 1024)])
def test_triton_matches_reference(triton_interpreter, generator, shape, block):
    from pkgd_kernels import activation_triton

    x = torch.randn(shape, generator=generator) * 4
    rows = x.reshape(-1, shape[-1])
    out = torch.empty(rows.shape[0], shape[-1] // 2)
    activation_triton.launch_silu_and_mul(rows, out, block=block)
    want = silu_and_mul_ref(x)
    torch.testing.assert_close(out.view(want.shape), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(silu_and_mul_triton(x), want, atol=1e-6, rtol=1e-6)


def test_triton_strided_and_bf16(triton_interpreter, generator):
    wide = torch.randn(4, 40, generator=generator)
    x = wide[:, 4:36]  # row stride 40
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), atol=1e-6, rtol=1e-6)
    xb = x.to(torch.bfloat16)
    got = silu_and_mul_triton(xb)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, silu_and_mul_ref(xb), atol=1e-5, rtol=2**-6)


def test_dispatcher_on_cpu_runs_the_reference(generator):
    x = torch.randn(3, 8, generator=generator)
    assert torch.equal(silu_and_mul(x), silu_and_mul_ref(x))


@pytest.mark.parametrize("op", [silu_and_mul_ref, silu_and_mul_triton])
def test_bad_inputs_raise(op):
    with pytest.raises(ValueError, match="even last dim"):
        op(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="x must be float32"):
        op(torch.zeros(2, 8, dtype=torch.int64))


def test_gelu_tanh_reference_matches_formula(generator):
    x = torch.randn(5, 2 * 12, generator=generator, dtype=torch.float64) * 3
    gate, up = x[:, :12], x[:, 12:]
    want = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3))) * up
    torch.testing.assert_close(gelu_tanh_and_mul_ref(x.float()), want.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gelu_tanh_and_mul(x.float()), want.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(3, 16), (4, 2 * 37), (2, 3, 2 * 5)])
def test_gelu_tanh_triton_matches_reference(triton_interpreter, generator, shape):
    x = torch.randn(shape, generator=generator) * 4
    want = gelu_tanh_and_mul_ref(x)
    torch.testing.assert_close(gelu_tanh_and_mul_triton(x), want, atol=1e-5, rtol=1e-5)
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(gelu_tanh_and_mul_triton(xb), gelu_tanh_and_mul_ref(xb), atol=1e-2, rtol=2**-6)

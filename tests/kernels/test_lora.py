"""add_lora: the reference against a per-token loop written from the definition, the CPU form
and the Triton kernels (interpreted) against the reference, on a mixed batch of base-model
tokens (slot -1) and tokens of several adapters of different ranks."""

from __future__ import annotations

import pytest
import torch

from pkgd_kernels import add_lora, add_lora_cpu, add_lora_ref, add_lora_triton

FP32 = dict(atol=1e-5, rtol=1e-5)


def _case(generator, t=11, k=40, n=72, s=3, r=8, dtype=torch.float32):
    x = torch.randn(t, k, generator=generator).to(dtype)
    y = torch.randn(t, n, generator=generator).to(dtype)
    a = torch.randn(s, r, k, generator=generator).to(dtype)
    b = torch.randn(s, n, r, generator=generator).to(dtype)
    a[1, 4:] = 0  # slot 1 holds a rank-4 adapter: zero padding past its rank
    b[1, :, 4:] = 0
    slots = torch.tensor([-1, 0, 0, 2, -1, 1, 1, 1, 2, 0, -1][:t], dtype=torch.int64)
    return y, x, a, b, slots


def _loop(y, x, a, b, slots):
    out = y.clone().double()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            out[i] += b[s].double() @ (a[s].double() @ x[i].double())
    return out


def test_reference_is_the_definition(generator):
    y, x, a, b, slots = _case(generator)
    want = _loop(y, x, a, b, slots)
    got = add_lora_ref(y.clone(), x, a, b, slots)
    torch.testing.assert_close(got.double(), want, **FP32)
    assert torch.equal(got[slots < 0], y[slots < 0])  # base tokens untouched, bit for bit


@pytest.mark.parametrize("active", [None, [0, 1, 2]])
def test_cpu_form_matches_reference(generator, active):
    y, x, a, b, slots = _case(generator)
    want = add_lora_ref(y.clone(), x, a, b, slots)
    got = add_lora_cpu(y.clone(), x, a, b, slots, active=active)
    torch.testing.assert_close(got, want, **FP32)
    kept = add_lora_cpu(y.clone(), x, a, b, slots, active=active, lora_b_t=b.transpose(1, 2).contiguous())
    torch.testing.assert_close(kept, got, **FP32)
    assert torch.equal(got[slots < 0], y[slots < 0])
    torch.testing.assert_close(add_lora(y.clone(), x, a, b, slots), want, **FP32)


def test_cpu_form_one_slot_in_the_middle(generator):
    y, x, a, b, _ = _case(generator)
    slots = torch.full((x.shape[0],), -1, dtype=torch.int64)
    slots[3:6] = 1
    torch.testing.assert_close(add_lora_cpu(y.clone(), x, a, b, slots), add_lora_ref(y.clone(), x, a, b, slots), **FP32)


def test_all_base_changes_nothing(generator):
    y, x, a, b, slots = _case(generator)
    slots[:] = -1
    assert torch.equal(add_lora_cpu(y.clone(), x, a, b, slots), y)
    assert torch.equal(add_lora_ref(y.clone(), x, a, b, slots), y)


def test_shape_errors(generator):
    y, x, a, b, slots = _case(generator)
    with pytest.raises(ValueError, match="shapes disagree"):
        add_lora_ref(y, x[:, :-1], a, b, slots)
    with pytest.raises(ValueError, match="token_slots"):
        add_lora_cpu(y, x, a, b, slots[:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(triton_interpreter, generator, dtype):
    y, x, a, b, slots = _case(generator, k=100, n=130, dtype=dtype)  # k, n not multiples of the blocks
    want = add_lora_ref(y.clone(), x, a, b, slots)
    got = add_lora_triton(y.clone(), x, a, b, slots)
    # float32: summation order over k=100 products of magnitude ~10 (ref: bmm; kernel: blocks of 64)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=2**-6)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    assert torch.equal(got[slots < 0], y[slots < 0])

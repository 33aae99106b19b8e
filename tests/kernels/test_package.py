"""The package surface: every op's forms with one signature (dispatchers add keyword-only
options), C forms on the kernels handle, and a Triton-free import."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import pkgd_kernels


def _positional(f) -> list[str]:
    """Names of ``f``'s parameters that are not keyword-only (``self`` dropped)."""
    params = inspect.signature(f).parameters.values()
    return [p.name for p in params if p.kind != p.KEYWORD_ONLY and p.name != "self"]


def test_every_op_has_its_forms_with_one_signature():
    for op, suffixes in [
        *((op, ("", "_ref", "_cpu", "_triton")) for op in pkgd_kernels.OPS),
        *((op, ("", "_ref")) for op in pkgd_kernels.CPU_OPS),
    ]:
        forms = [getattr(pkgd_kernels, op + suffix) for suffix in suffixes]
        signatures = {tuple(_positional(f)) for f in forms}
        assert len(signatures) == 1, f"{op}: {signatures}"
        assert all(f.__doc__ for f in forms), op
        # only the dispatcher adds options, all keyword-only with defaults
        for f in forms[1:]:
            assert not any(
                p.kind == p.KEYWORD_ONLY for p in inspect.signature(f).parameters.values()
            ) or f.__name__.endswith("_cpu"), f


def test_every_c_form_is_a_method_of_the_kernels_handle_with_the_ops_signature():
    from pkgd_kernels.cpu import CpuKernels

    for op in pkgd_kernels.C_OPS:
        method = getattr(CpuKernels, op)
        assert _positional(method) == _positional(getattr(pkgd_kernels, op)), op
        assert method.__doc__ and "kernels" in inspect.signature(getattr(pkgd_kernels, op)).parameters, op
        predicate = "takes_rms_norm" if op == "fused_add_rms_norm" else f"takes_{op}"
        assert hasattr(CpuKernels, predicate) or op == "gather_packed", op


def test_import_does_not_load_triton():
    code = "import sys, pkgd_kernels; print('triton' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_cpu_dispatch_needs_no_triton():
    """A CPU call through every dispatcher runs the reference without importing Triton."""
    code = """
import sys, torch, pkgd_kernels as K
x = torch.randn(3, 8)
K.rms_norm(x, torch.ones(8), 1e-6)
K.silu_and_mul(x)
K.top_k_top_p_mask(x, torch.zeros(3, dtype=torch.int32), torch.ones(3))
print('triton' in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def _empty_calls(ops):
    """One zero-sized call per op (no tokens, no rows or an empty vocabulary)."""
    import torch

    cache = torch.zeros(2, 4, 2, 8)
    no_tokens = torch.zeros(0, dtype=torch.int64)
    return [
        ops("reshape_and_cache")(torch.zeros(0, 2, 8), torch.zeros(0, 2, 8), cache, cache.clone(), no_tokens),
        ops("rotary_embedding")(no_tokens, torch.zeros(0, 16), torch.zeros(0, 8), 8, torch.zeros(4, 8), True),
        ops("silu_and_mul")(torch.zeros(0, 8)),
        ops("rms_norm")(torch.zeros(0, 8), torch.ones(8), 1e-6),
        ops("fused_add_rms_norm")(torch.zeros(0, 8), torch.zeros(0, 8), torch.ones(8), 1e-6),
        ops("top_k_top_p_mask")(torch.zeros(0, 8), torch.zeros(0, dtype=torch.int32), torch.zeros(0)),
        ops("top_k_top_p_mask")(torch.zeros(2, 0), torch.ones(2, dtype=torch.int32), torch.full((2,), 0.5)),
    ]


@pytest.mark.parametrize("impl", ["ref", "cpu", "triton"])
def test_zero_sized_inputs(request, impl):
    if impl == "triton":
        request.getfixturevalue("triton_interpreter")
    results = _empty_calls(lambda op: getattr(pkgd_kernels, f"{op}_{impl}"))
    assert results[0] is None and results[1][0].shape == (0, 16) and results[2].shape == (0, 4)
    assert results[-1].shape == (2, 0)

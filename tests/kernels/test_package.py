"""The package surface: every op in three forms with one signature, and a Triton-free import."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pkgd_kernels


def test_every_op_has_reference_triton_and_dispatcher_with_one_signature():
    for op in pkgd_kernels.OPS:
        forms = [getattr(pkgd_kernels, op + suffix) for suffix in ("", "_ref", "_triton")]
        signatures = {str(inspect.signature(f)) for f in forms}
        assert len(signatures) == 1, f"{op}: {signatures}"
        assert all(f.__doc__ for f in forms), op


def test_import_does_not_load_triton():
    code = "import sys, pkgd_kernels; print('triton' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
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
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"

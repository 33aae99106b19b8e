"""Every Triton kernel compiles for a real GPU target (sm_90 PTX and cubin, through the ptxas
bundled with Triton) with the launch parameters the public functions use. Catches what the
interpreter tests cannot: code the Triton compiler rejects, and shared memory beyond the
target's. Runs in a subprocess: compiled-mode Triton and the interpreter cannot share one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pkgd_kernels.compile_check",
            "--arch",
            "90",
            "--dtype",
            "bfloat16",
            "--dtype",
            "float32",
            "--head-dim",
            "64",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    compiled = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    kernels = {line.split()[2] for line in compiled}
    assert kernels == {
        "_reshape_and_cache_kernel",
        "_rms_norm_kernel",
        "_silu_and_mul_kernel",
        "_gelu_tanh_and_mul_kernel",
        "_rotary_kernel",
        "_decode_kernel",
        "_reduce_kernel",
        "_prefill_kernel",
        "_top_k_top_p_kernel",
        "_shrink_kernel",
        "_expand_kernel",
    }
    assert "0 failure(s)" in result.stdout

"""Runners for the runner tests. Kept out of conftest.py: pytest imports that file under its own
module name while tests import ``tests.runner.conftest``, which would give each its own copy
of `C_KERNELS` (the `cpu_path` fixture's switch would not reach the runners tests build)."""

from __future__ import annotations

import os

import torch

from pkgd.config.vllm_config import VllmConfig
from pkgd.model_files.resolve import resolve_model


def onednn_bf16_view_expected() -> bool:
    """Whether oneDNN's bf16 packing on this host should be one the C kernels read as a view:
    oneDNN packs bf16 at all (`onednn_packs_bf16`) and the CPU computes bf16 natively (AVX512-BF16
    or AMX, whose packings are the [N/B, K/2, B, 2] ones); an ``ONEDNN_MAX_CPU_ISA`` below those
    (how an AVX2 or AVX-512-without-bf16 host is emulated) means no. Elsewhere bf16 weights stay
    unpacked and bf16 runs without the C GEMV and the one-call decode step."""
    from pkgd.runner.layers.linear import onednn_packs_bf16
    from pkgd.runner.loader.dtype import cpu_has_native_bf16

    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    limited = isa not in ("", "ALL", "DEFAULT") and "BF16" not in isa and "AMX" not in isa
    return onednn_packs_bf16() and cpu_has_native_bf16() and not limited


# Whether runners built by `make_runner` load the C kernels (the `cpu_path` fixture turns it off).
C_KERNELS = {"enabled": True}


def make_runner(model_dir, *, cpu_kernels=None, **model_kw):
    from pkgd.runner.model_runner import ModelRunner

    enabled = C_KERNELS["enabled"] if cpu_kernels is None else cpu_kernels
    cfg = VllmConfig(
        model={"source": str(model_dir), "dtype": "float32", **model_kw}, parallel={"cpu_kernels": enabled}
    )
    return ModelRunner(cfg, resolve_model(cfg.model), device=torch.device("cpu"))


class LogitsRecorder:
    """Wraps ``model.compute_logits`` to keep every logits tensor it returns."""

    def __init__(self, runner) -> None:
        self.calls: list[torch.Tensor] = []
        inner = runner.model.compute_logits

        def record(hidden):
            out = inner(hidden)
            self.calls.append(out.clone())
            return out

        runner.model.compute_logits = record

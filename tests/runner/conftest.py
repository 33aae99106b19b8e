from __future__ import annotations

import pytest
import torch

from pkgd.config.vllm_config import VllmConfig
from pkgd.model_files.resolve import resolve_model
from tests.runner.tiny_models import build_tiny


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """arch -> (model_dir, transformers model), built once per session."""
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            d = tmp_path_factory.mktemp(arch)
            cache[arch] = (d, build_tiny(arch, d))
        return cache[arch]

    return get


# Whether runners built by `make_runner` load the C kernels (the `cpu_path` fixture turns it off).
if __name__ == "tests.runner.conftest":
    C_KERNELS = {"enabled": True}  # parallel.cpu_kernels of the runners make_runner builds
else:  # pytest's own copy of this file ("runner.conftest"): share the dict the tests import
    from tests.runner.conftest import C_KERNELS


def make_runner(model_dir, *, cpu_kernels=None, **model_kw):
    from pkgd.runner.model_runner import ModelRunner

    enabled = C_KERNELS["enabled"] if cpu_kernels is None else cpu_kernels
    cfg = VllmConfig(model={"source": str(model_dir), "dtype": "float32", **model_kw}, parallel={"cpu_kernels": enabled})
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


@pytest.fixture(scope="session")
def c_kernels():
    """The C kernels (`pkgd_kernels.cpu.CpuKernels`), loaded once; skips where they cannot be
    built."""
    from pkgd_kernels import cpu

    try:
        return cpu.load(cpu.default_cache_dir())
    except cpu.CpuKernelsUnavailable as e:
        pytest.skip(f"C kernels unavailable: {e}")


@pytest.fixture(params=["c-kernels", "pytorch"])
def cpu_path(request, monkeypatch):
    """Run a test on both CPU paths: the C kernels (skipped where they cannot be built) and
    plain PyTorch (``parallel.cpu_kernels: false``, so a runner `make_runner` builds loads
    none). Returns the kernels handle for layers a test builds itself (None on the PyTorch path)."""
    if request.param == "pytorch":
        monkeypatch.setitem(C_KERNELS, "enabled", False)
        return None
    return request.getfixturevalue("c_kernels")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The engine owns its thread count; tests use one thread, which stays fast when other
    processes share the cores (2-thread OpenMP regions stall under contention)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

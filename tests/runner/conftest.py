from __future__ import annotations

import pytest
import torch
from tests.runner.factory import C_KERNELS, LogitsRecorder, make_runner  # noqa: F401 (re-exported)
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

"""Fixtures for the kernel tests: Triton's CPU interpreter, confined to these tests.

``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a kernel, so the fixture sets the
variable only while it (re)imports the ``pkgd_kernels.*_triton`` modules and restores it
afterwards: other tests and the processes they start never see it. The interpreted kernels then
run on CPU tensors through the public ``*_triton`` functions.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

TRITON_MODULES = (
    "cache_triton",
)


@pytest.fixture(scope="session")
def triton_interpreter() -> None:
    """Make every ``pkgd_kernels`` Triton kernel run under Triton's interpreter on CPU."""
    pytest.importorskip("triton")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        for name in TRITON_MODULES:
            module = f"pkgd_kernels.{name}"
            if module in sys.modules:  # decorated earlier, maybe without the interpreter
                importlib.reload(sys.modules[module])
            else:
                importlib.import_module(module)


@pytest.fixture
def generator() -> torch.Generator:
    """A seeded CPU generator, so every test draws the same inputs on every run."""
    return torch.Generator().manual_seed(0)

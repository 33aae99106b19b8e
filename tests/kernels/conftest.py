"""Fixtures for the kernel tests: Triton's CPU interpreter, confined to these tests.

``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a function, Triton's own language
helpers included, so Triton must first be imported with the variable set. The session fixture
does that on first use and (re)imports the ``pkgd_kernels.*_triton`` modules; the per-test
fixture keeps the variable set only while an interpreter test runs, so other tests and the
processes they start never see it. The interpreted kernels run on CPU tensors through the
public ``*_triton`` functions.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

TRITON_MODULES = (
    "cache_triton",
    "attention_decode_triton",
    "attention_prefill_triton",
    "norm_triton",
    "activation_triton",
    "rotary_triton",
    "sampling_triton",
)


@pytest.fixture(scope="session")
def _interpreted_kernels() -> None:
    """Import Triton and the kernel modules with ``TRITON_INTERPRET=1``, once per session."""
    standard = sys.modules.get("triton.language.standard")
    if standard is not None and type(standard.sigmoid).__name__ != "InterpretedFunction":
        pytest.fail(
            "Triton was imported in compiled mode before the kernel tests ran, so its language "
            "helpers cannot be interpreted; run tests/kernels in a pytest process of its own"
        )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        pytest.importorskip("triton")
        importlib.import_module("triton.experimental.gluon")  # imported lazily on first launch
        for name in TRITON_MODULES:
            module = f"pkgd_kernels.{name}"
            if module in sys.modules:  # decorated earlier, maybe without the interpreter
                importlib.reload(sys.modules[module])
            else:
                importlib.import_module(module)


@pytest.fixture
def triton_interpreter(_interpreted_kernels, monkeypatch) -> None:
    """Run this test's Triton kernels under Triton's interpreter on CPU tensors.

    The variable stays set for the test itself too, for anything Triton imports lazily at
    launch; monkeypatch removes it when the test ends.
    """
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def generator() -> torch.Generator:
    """A seeded CPU generator, so every test draws the same inputs on every run."""
    return torch.Generator().manual_seed(0)

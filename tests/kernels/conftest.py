"""Fixtures for the kernel tests: Triton's CPU interpreter, confined to these tests.

``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a function, Triton's own language
helpers included, so Triton must first be imported with the variable set. The session fixture
does that on first use and (re)imports the ``pkgd_kernels.*_triton`` modules; the per-test
fixture keeps the variable set only while an interpreter test runs, so other tests and the
processes they start never see it. The interpreted kernels run on CPU tensors through the
public ``*_triton`` functions.

With ``PKGD_KERNEL_TEST_DEVICE=cuda`` (``benchmarks/gpu_check.sh``) the same tests run the
compiled kernels on the GPU instead: no interpreter, and every ``*_triton`` function (of the
test module and of the ``pkgd_kernels.*_triton`` modules) is wrapped to copy its CPU tensor
arguments to the device, run there, and copy the results, and any argument the kernel wrote
into, back; the tests' comparisons against the references stay as written.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys

import pytest
import torch

DEVICE = os.environ.get("PKGD_KERNEL_TEST_DEVICE", "cpu")

TRITON_MODULES = (
    "cache_triton",
    "attention_decode_triton",
    "attention_prefill_triton",
    "norm_triton",
    "activation_triton",
    "rotary_triton",
    "sampling_triton",
    "lora_triton",
)


@pytest.fixture(scope="session")
def _interpreted_kernels() -> None:
    """Import Triton and the kernel modules with ``TRITON_INTERPRET=1``, once per session
    (compiled, on ``PKGD_KERNEL_TEST_DEVICE``, when that names a device)."""
    if DEVICE != "cpu":
        if not torch.cuda.is_available():
            pytest.fail(f"PKGD_KERNEL_TEST_DEVICE={DEVICE} but torch sees no CUDA device")
        for name in TRITON_MODULES:
            importlib.import_module(f"pkgd_kernels.{name}")
        return
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
def triton_interpreter(_interpreted_kernels, monkeypatch, request) -> None:
    """Run this test's Triton kernels under Triton's interpreter on CPU tensors (or compiled
    on ``PKGD_KERNEL_TEST_DEVICE``, see the module docstring).

    The variable stays set for the test itself too, for anything Triton imports lazily at
    launch; monkeypatch removes it when the test ends.
    """
    if DEVICE != "cpu":
        _run_triton_on(DEVICE, monkeypatch, request.module)
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _run_triton_on(device: str, monkeypatch, test_module) -> None:
    """Wrap every ``*_triton`` function of ``test_module`` and every public function of the
    ``pkgd_kernels.*_triton`` modules with `_on_device` for this test."""
    targets = [
        (test_module, name)
        for name, obj in vars(test_module).items()
        if name.endswith("_triton") and inspect.isfunction(obj)
    ]
    for mod_name in TRITON_MODULES:
        mod = sys.modules[f"pkgd_kernels.{mod_name}"]
        targets += [
            (mod, name)
            for name, obj in vars(mod).items()
            if not name.startswith("_") and inspect.isfunction(obj) and obj.__module__ == mod.__name__
        ]
    for owner, name in targets:
        monkeypatch.setattr(owner, name, _on_device(getattr(owner, name), device))


def _on_device(fn, device: str):
    """``fn`` run on ``device``: CPU tensor arguments (also inside lists and tuples) are copied
    there; afterwards each one the call changed gets the new values copied back, and tensor
    results come back to the CPU."""
    if getattr(fn, "_pkgd_on_device", False):
        return fn

    @functools.wraps(fn)
    def run(*args, **kwargs):
        moved: list[tuple[torch.Tensor, torch.Tensor]] = []

        def to(x):
            if isinstance(x, torch.Tensor) and x.device.type == "cpu":
                d = x.to(device)
                moved.append((x, d))
                return d
            if isinstance(x, tuple) and hasattr(x, "_fields"):
                return type(x)(*(to(v) for v in x))
            if isinstance(x, (list, tuple)):
                return type(x)(to(v) for v in x)
            return x

        out = fn(*[to(a) for a in args], **{k: to(v) for k, v in kwargs.items()})
        torch.cuda.synchronize()
        for cpu, dev in moved:
            back = dev.cpu()
            if not torch.equal(back, cpu):  # written by the kernel (a cache, an out= buffer)
                cpu.copy_(back)
        return _to_cpu(out)

    run._pkgd_on_device = True
    return run


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_to_cpu(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


@pytest.fixture
def generator() -> torch.Generator:
    """A seeded CPU generator, so every test draws the same inputs on every run."""
    return torch.Generator().manual_seed(0)

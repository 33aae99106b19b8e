"""Session-wide set-up shared by every test package."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config):
    """Import Triton once with its CPU interpreter on, before any test imports it.

    ``triton.jit`` decides compiled vs interpreted when a function (Triton's own language
    helpers included) is decorated, i.e. at import. Tests that never run kernels may import
    Triton indirectly (through torch or transformers); importing it here first lets the
    kernel tests (tests/kernels, run under ``TRITON_INTERPRET=1``) share the session with
    them. The variable itself is restored, so processes started by tests do not inherit it.
    Not with ``PKGD_KERNEL_TEST_DEVICE`` set: the kernel tests then run compiled on that
    device (tests/kernels/conftest.py), and Triton must be imported without the interpreter.
    """
    if os.environ.get("PKGD_KERNEL_TEST_DEVICE", "cpu") != "cpu":
        return
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
        import triton.experimental.gluon  # noqa: F401  (imported lazily at first launch)
        import triton.language  # noqa: F401
    except ImportError:
        pass
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The embedded SmolLM2's tokenizer, read from its GGUF (no engine, no torch)."""
    from tests.smollm2 import smollm2_gguf

    from pkgd.frontend.tokenizer import load_tokenizer

    return load_tokenizer(None, tokenizer=str(smollm2_gguf()))

"""Fixtures of the fault suite: a real daemon per module (``pkgd serve``, real engine core and
API servers) serving a tiny random-weight Llama with SmolLM2's tokenizer, so every start of an
engine core costs seconds, not a model load."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "supervisor"))  # supervisor_helpers

from cases import build_fault_model, fault_config, long_stream_config  # noqa: E402
from supervisor_helpers import Daemon  # noqa: E402


@pytest.fixture(scope="module")
def fault_dir():
    path = Path(tempfile.mkdtemp(prefix="pkgd-f-", dir="/tmp"))  # short: Unix socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_model(fault_dir):
    path = fault_dir / "tiny"
    build_fault_model(path)
    return path


@pytest.fixture(scope="module")
def daemon(fault_dir, tiny_model):
    """A running daemon for the module's cases (a case that stops it ends the module)."""
    work = fault_dir / "d"
    work.mkdir()
    d = Daemon(work, fault_config(tiny_model), real=True)
    try:
        d.wait_ready(600)
        yield d
    finally:
        d.cleanup()


@pytest.fixture(scope="module")
def long_daemon(fault_dir, tiny_model):
    """A running daemon of `long_stream_config` (a short drain_timeout, room for long streams)."""
    work = fault_dir / "long"
    work.mkdir()
    d = Daemon(work, long_stream_config(tiny_model), real=True)
    try:
        d.wait_ready(600)
        yield d
    finally:
        d.cleanup()

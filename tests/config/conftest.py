"""Hermetic composition: no /etc/pkgd, no PKGD_ variables (nor VLLM_API_KEY) of the machine running the tests."""

import os
import textwrap
from pathlib import Path

import pytest

from pkgd.config import layers


@pytest.fixture(autouse=True)
def hermetic(monkeypatch, tmp_path_factory):
    monkeypatch.setattr(layers, "SYSTEM_CONFIG_DIR", str(tmp_path_factory.mktemp("etc") / "absent"))
    for name in list(os.environ):
        if name.upper().startswith("PKGD_") or name in layers.VLLM_ENV:
            monkeypatch.delenv(name)


@pytest.fixture
def tree(tmp_path):
    """Write a system tree: ``tree({"pkgd.yaml": "...", "conf.d/10-a.yaml": "..."})`` -> its path."""

    def write(files: dict[str, str]) -> Path:
        root = tmp_path / "etc-pkgd"
        root.mkdir(exist_ok=True)
        for name, text in files.items():
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text))
        return root

    return write

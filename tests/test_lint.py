"""The tree passes ruff's lint rules, ruff's formatter and mypy, as configured in pyproject.toml.

All three run in a subprocess with this interpreter (the pinned versions from the ``test``
extra); mypy keeps its incremental cache in ``.mypy_cache`` so a re-run after a small change
takes seconds rather than a full check.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_check_finds_nothing() -> None:
    result = _run("ruff", "check", "--no-fix", "--output-format", "concise", ".")
    assert result.returncode == 0, f"ruff check found problems:\n{result.stdout}{result.stderr}"


def test_ruff_format_changes_nothing() -> None:
    result = _run("ruff", "format", "--check", ".")
    assert result.returncode == 0, f"ruff format would reformat (run `ruff format .`):\n{result.stdout}{result.stderr}"


def test_mypy_finds_nothing() -> None:
    # files, overrides and flags come from [tool.mypy] in pyproject.toml
    result = _run("mypy", "--show-error-codes")
    assert result.returncode == 0, f"mypy found problems:\n{result.stdout}{result.stderr}"

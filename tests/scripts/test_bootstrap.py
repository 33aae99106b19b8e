"""scripts/bootstrap's output, with a stand-in Python that records what it was asked to do
(the real install takes minutes; the README states its time)."""

from __future__ import annotations

import os
import pty
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Stands in for python3 and, once `-m venv` ran, for .venv/bin/python: logs its argv and the
# PYTHONWARNINGS it got; `-m venv DIR` creates DIR/bin/python as a copy of itself.
STUB = """#!/usr/bin/env bash
echo "$* | PYTHONWARNINGS=$PYTHONWARNINGS" >> "$STUB_LOG"
if [ "$1" = "--version" ]; then echo "Python 3.11.9"; exit 0; fi
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; fi
"""


@pytest.fixture
def clone(tmp_path):
    root = tmp_path / "pkgd"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "bootstrap", root / "scripts" / "bootstrap")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    stub = tmp_path / "python3"
    stub.write_text(STUB)
    stub.chmod(0o755)
    return root, stub, tmp_path / "calls.log"


def _run(root: Path, stub: Path, log: Path, *, tty: bool) -> str:
    env = {"PATH": os.environ["PATH"], "PYTHON": str(stub), "STUB_LOG": str(log)}
    if not tty:
        return subprocess.run(
            [str(root / "scripts" / "bootstrap")], env=env, capture_output=True, text=True, check=True, timeout=60
        ).stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [str(root / "scripts" / "bootstrap")], env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave
    )
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(60) == 0
    return out.decode().replace("\r\n", "\n")


def test_every_step_is_announced_and_pip_is_quiet_off_a_terminal(clone):
    root, stub, log = clone
    err = _run(root, stub, log, tty=False)
    steps = [line for line in err.splitlines() if line.startswith("pkgd: [")]
    assert [s[:11] for s in steps] == [f"pkgd: [{i}/5]" for i in range(1, 6)]
    assert "creating .venv with Python 3.11.9" in steps[0] and "torch 2.13.0" in steps[2]
    assert "first run only" in err and "pkgd: installed in " in err
    pips = [line for line in log.read_text().splitlines() if line.startswith("-m pip install")]
    assert len(pips) == 4 and all("--quiet" in line for line in pips)
    assert all("ignore:Editable installation" in line for line in pips)  # setuptools' notice is filtered
    log.unlink()
    assert _run(root, stub, log, tty=False) == "" and not log.exists()  # installed: nothing to do


def test_on_a_terminal_pip_shows_its_own_progress(clone):
    root, stub, log = clone
    out = _run(root, stub, log, tty=True)
    assert out.count("pkgd: [") == 5
    pips = [line for line in log.read_text().splitlines() if line.startswith("-m pip install")]
    assert len(pips) == 4 and not any("--quiet" in line for line in pips)

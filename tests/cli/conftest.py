"""Run `pkgd` as a user would: a real process, with a report of the heavy modules it imported."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pkgd.config import layers

# Runs pkgd's main() and writes the top-level names of heavy modules it imported to $MODULES_OUT.
DRIVER = """
import json, os, sys
from pkgd.cli.main import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'hydra', 'triton'})
with open(os.environ['MODULES_OUT'], 'w') as f:
    json.dump(heavy, f)
sys.exit(rc)
"""


class Result:
    def __init__(self, proc: subprocess.CompletedProcess, heavy: list[str]):
        self.rc, self.out, self.err, self.heavy = proc.returncode, proc.stdout, proc.stderr, heavy


@pytest.fixture
def pkgd(tmp_path):
    """``pkgd(*args, env={...})`` runs pkgd in a child process; no PKGD_ (or VLLM_API_KEY) variables leak in."""

    def run(*args: str, env: dict | None = None) -> Result:
        out = tmp_path / "modules.json"
        child_env = {
            k: v for k, v in os.environ.items() if not k.upper().startswith("PKGD_") and k not in layers.VLLM_ENV
        }
        child_env.update(env or {}, MODULES_OUT=str(out))
        proc = subprocess.run(
            [sys.executable, "-c", DRIVER, *args],
            env=child_env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        heavy = json.loads(out.read_text()) if out.exists() else ["<driver failed>"]
        return Result(proc, heavy)

    return run


@pytest.fixture(autouse=True)
def hermetic(monkeypatch, tmp_path_factory):
    monkeypatch.setattr(layers, "SYSTEM_CONFIG_DIR", str(tmp_path_factory.mktemp("etc") / "absent"))
    for name in list(os.environ):
        if name.upper().startswith("PKGD_") or name in layers.VLLM_ENV:
            monkeypatch.delenv(name)


@pytest.fixture
def config_tree(tmp_path):
    def write(name: str, files: dict[str, str]) -> Path:
        root = tmp_path / name
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        root.mkdir(exist_ok=True)
        return root

    return write

"""The runtime directory: where it is, who may use it, config.json."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from pkgd.config.vllm_config import VllmConfig
from pkgd.supervisor.runtime import RuntimeDir, RuntimeDirError, resolve_runtime_dir


def test_resolution_order():
    env = {"RUNTIME_DIRECTORY": "/run/pkgd:/run/other", "XDG_RUNTIME_DIR": "/run/user/7"}
    assert resolve_runtime_dir("/srv/run", env) == Path("/srv/run")
    assert resolve_runtime_dir(None, env) == Path("/run/pkgd")
    assert resolve_runtime_dir(None, {"XDG_RUNTIME_DIR": "/run/user/7"}) == Path("/run/user/7/pkgd")
    assert resolve_runtime_dir(None, {}) == Path(f"/tmp/pkgd-{os.getuid()}")


def test_private_locked_and_config_json_is_0600_with_secrets(tmp_path):
    path = tmp_path / "run"
    path.mkdir(mode=0o755)
    rt = RuntimeDir(path)
    rt.acquire()
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700  # tightened
        with pytest.raises(RuntimeDirError, match=f"in use by another pkgd \\(pid {os.getpid()}\\)"):
            RuntimeDir(path).acquire()
        config = VllmConfig.model_validate({"frontend": {"api_keys": ["sk-secret"]}})
        rt.write_config(config)
        assert stat.S_IMODE(rt.config_file.stat().st_mode) == 0o600
        assert VllmConfig.model_validate(json.loads(rt.config_file.read_text())) == config
        assert "sk-secret" in rt.config_file.read_text()
    finally:
        rt.release()
    assert not rt.config_file.exists()
    again = RuntimeDir(path)
    again.acquire()  # free again
    again.release()


def test_a_path_too_long_for_unix_sockets_is_refused(tmp_path):
    with pytest.raises(RuntimeDirError, match="too long for Unix socket paths"):
        RuntimeDir(tmp_path / ("x" * 100)).acquire()

"""The runtime directory: where it is, who may use it, and that it is never reached through a symlink."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pkgd.supervisor.runtime import RuntimeDir, RuntimeDirError, default_runtime_dir, resolve_runtime_dir


def test_resolution_order():
    env = {"RUNTIME_DIRECTORY": "/run/pkgd:/run/other", "XDG_RUNTIME_DIR": "/run/user/7"}
    assert resolve_runtime_dir("/srv/run", env) == Path("/srv/run")
    assert resolve_runtime_dir(None, env) == Path("/run/pkgd")
    assert default_runtime_dir({"XDG_RUNTIME_DIR": "/run/user/7"}, uid=7) == Path("/run/user/7/pkgd")
    assert default_runtime_dir({}, uid=7) == Path("/tmp/pkgd-7")
    assert default_runtime_dir({}, uid=0) == Path("/run/pkgd")  # root: never /tmp
    assert default_runtime_dir({"XDG_RUNTIME_DIR": "/run/user/0"}, uid=0) == Path("/run/pkgd")


def test_private_and_locked(tmp_path):
    path = tmp_path / "run"
    path.mkdir(mode=0o755)
    rt = RuntimeDir(path)
    rt.acquire()
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700  # tightened
        with pytest.raises(RuntimeDirError, match=f"in use by another pkgd \\(pid {os.getpid()}\\)"):
            RuntimeDir(path).acquire()
    finally:
        rt.release()
    again = RuntimeDir(path)
    again.acquire()  # free again
    again.release()


def test_a_symlinked_runtime_dir_is_refused_and_its_target_untouched(tmp_path):
    """What a root daemon did with /tmp/pkgd-0 replaced by a symlink: chmod the target, empty
    it, write secrets there. Now it refuses, and the target keeps its mode and files."""
    target = tmp_path / "victim"
    target.mkdir(mode=0o755)
    (target / "engine-1-0.sock").write_text("precious")
    (target / "control.sock").write_text("precious")
    link = tmp_path / "run"
    link.symlink_to(target)
    with pytest.raises(RuntimeDirError, match="is a symbolic link; refusing"):
        RuntimeDir(link).acquire()
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert sorted(p.name for p in target.iterdir()) == ["control.sock", "engine-1-0.sock"]


def test_a_file_in_its_place_is_refused(tmp_path):
    (tmp_path / "run").write_text("x")
    with pytest.raises(RuntimeDirError, match="not a directory"):
        RuntimeDir(tmp_path / "run").acquire()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_directory_others_can_write_is_refused(tmp_path, mode):
    path = tmp_path / "run"
    path.mkdir()
    path.chmod(mode)
    with pytest.raises(RuntimeDirError, match="writable by group or others"):
        RuntimeDir(path).acquire()
    assert stat.S_IMODE(path.stat().st_mode) == mode


def test_a_directory_of_another_user_is_refused(tmp_path):
    if os.getuid() != 0:
        pytest.skip("needs root to give the directory away")
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    os.chown(path, 12345, 12345)
    with pytest.raises(RuntimeDirError, match="belongs to uid 12345"):
        RuntimeDir(path).acquire()


def test_a_parent_anyone_can_write_without_sticky_bit_is_refused(tmp_path):
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)
    with pytest.raises(RuntimeDirError, match="writable by anyone and not sticky"):
        RuntimeDir(parent / "run").acquire()
    parent.chmod(0o1777)  # like /tmp
    rt = RuntimeDir(parent / "run")
    rt.acquire()
    rt.release()


def test_stale_secrets_of_an_older_daemon_are_removed(tmp_path):
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    (path / "config.json").write_text('{"frontend": {"api_keys": ["sk-old"]}}')
    rt = RuntimeDir(path)
    rt.acquire()
    try:
        assert not (path / "config.json").exists()
    finally:
        rt.release()


def test_a_path_too_long_for_unix_sockets_is_refused(tmp_path):
    with pytest.raises(RuntimeDirError, match="too long for Unix socket paths"):
        RuntimeDir(tmp_path / ("x" * 100)).acquire()

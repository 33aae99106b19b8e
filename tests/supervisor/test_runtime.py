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


def _planted(tmp_path):
    """``open/evil`` -> ``victim``: a link another user (uid 65534) made in their own
    /tmp-like directory (sticky, writable by anyone), over a directory of root's that holds an
    older daemon's files."""
    victim = tmp_path / "victim"
    (victim / "run").mkdir(mode=0o755, parents=True)
    (victim / "run" / "control.sock").write_text("precious")
    opened = tmp_path / "open"
    opened.mkdir()
    opened.chmod(0o1777)
    (opened / "evil").symlink_to(victim)
    return opened, victim


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the link away")
def test_a_symlink_in_a_parent_another_user_controls_is_refused_and_its_target_untouched(tmp_path):
    """What a root daemon did with runtime_dir /tmp/x/evil/run, evil a link another user
    planted: chmod 0700 and empty victim/run. Now it refuses, naming the link."""
    opened, victim = _planted(tmp_path)
    os.chown(opened, 65534, 65534)
    os.lchown(opened / "evil", 65534, 65534)
    with pytest.raises(RuntimeDirError) as err:
        RuntimeDir(opened / "evil" / "run").acquire()
    assert f"{opened / 'evil'} is a symbolic link (to {victim})" in str(err.value)
    assert "belongs to uid 65534" in str(err.value) and str(err.value).startswith("supervisor.runtime_dir: ")
    assert stat.S_IMODE((victim / "run").stat().st_mode) == 0o755
    assert [p.name for p in (victim / "run").iterdir()] == ["control.sock"]


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the link away")
def test_a_link_of_another_user_in_roots_sticky_directory_is_refused(tmp_path):
    opened, victim = _planted(tmp_path)  # the directory is root's, like /tmp; the link is not
    os.lchown(opened / "evil", 65534, 65534)
    with pytest.raises(RuntimeDirError, match="it belongs to uid 65534"):
        RuntimeDir(opened / "evil" / "run").acquire()
    assert stat.S_IMODE((victim / "run").stat().st_mode) == 0o755


def test_a_link_in_a_directory_others_may_write_is_refused(tmp_path):
    opened, victim = _planted(tmp_path)
    opened.chmod(0o777)  # not sticky: anyone could replace the link
    with pytest.raises(RuntimeDirError, match=f"{opened} is writable by others and not sticky"):
        RuntimeDir(opened / "evil" / "run").acquire()
    assert stat.S_IMODE((victim / "run").stat().st_mode) == 0o755


def test_a_link_only_this_user_could_make_is_followed(tmp_path):
    """As /var/run -> /run: a link of root (or this user) in a directory only they may change."""
    (tmp_path / "real").mkdir()
    safe = tmp_path / "safe"
    safe.mkdir(mode=0o755)
    (safe / "abs").symlink_to(tmp_path / "real")
    (safe / "rel").symlink_to("../real/sub")
    for path in (safe / "abs" / "run", safe / "rel" / "deeper" / "run"):
        rt = RuntimeDir(path)
        rt.acquire()
        try:
            assert rt.control_socket.parent.resolve() == path.resolve()
            assert stat.S_IMODE(path.stat().st_mode) == 0o700 and (path / "pkgd.lock").exists()
        finally:
            rt.release()
    assert (tmp_path / "real" / "sub" / "deeper" / "run").is_dir()  # missing parents made on the way


@pytest.mark.skipif(
    os.getuid() != 0 or not os.path.islink("/var/run"), reason="needs root and /var/run as a link (Debian's -> /run)"
)
def test_var_run_still_works():
    path = Path("/var/run") / f"pkgd-test-{os.getpid()}"
    rt = RuntimeDir(path)
    rt.acquire()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    finally:
        rt.release()
        os.rmdir(path)


def test_a_symlink_loop_is_refused(tmp_path):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(RuntimeDirError, match="too many levels of symbolic links"):
        RuntimeDir(tmp_path / "a" / "run").acquire()


def test_a_file_as_a_parent_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(RuntimeDirError, match=f"{tmp_path / 'f'} is not a directory"):
        RuntimeDir(tmp_path / "f" / "run").acquire()


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

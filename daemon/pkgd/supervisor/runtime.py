"""The runtime directory: where the IPC sockets, the control socket and the lock live.

Resolution order (first that applies): ``supervisor.runtime_dir``; ``$RUNTIME_DIRECTORY``
(systemd's ``RuntimeDirectory=``, e.g. ``/run/pkgd``); ``/run/pkgd`` for root; for anyone else
``$XDG_RUNTIME_DIR/pkgd``, then ``/tmp/pkgd-<uid>``.

The control socket accepts commands and the engine sockets carry requests, so the directory
must be private to the daemon's user, and it is created and checked without following a
symlink (a root daemon must not be steered into chmodding, emptying and writing a directory
someone else chose): the last component is created with ``mkdir`` (which never follows a
link), opened with ``O_NOFOLLOW | O_DIRECTORY``, and owner and mode are checked on that open
directory (``fstat``): it must belong to this user and not be writable by group or others (a
mode that only lets others read it is tightened to 0700 through the descriptor), and its
parent must not be writable by others unless sticky (``/tmp``), so nobody can swap it. Anything
else is refused with a message naming the directory. Files inside are opened relative to the
directory's descriptor. The configuration is not kept here at all: children receive it over a
pipe (`pkgd.ipc.config_channel`).

One daemon per runtime directory: `RuntimeDir.acquire` takes an exclusive ``flock`` on
``pkgd.lock`` and fails with a clear message when another pkgd holds it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
from pathlib import Path

CONTROL_SOCKET = "control.sock"
LOCK_FILE = "pkgd.lock"
STALE_FILES = ("config.json", ".config.json.tmp")  # secrets written by pkgd versions before the config pipe
SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes on Linux, NUL included
ROOT_RUNTIME_DIR = "/run/pkgd"


class RuntimeDirError(Exception):
    """The runtime directory is unusable (permissions, owner, a symlink, or another pkgd uses it)."""


def default_runtime_dir(environ: dict[str, str] | None = None, uid: int | None = None) -> Path:
    """The runtime directory when ``supervisor.runtime_dir`` is null (see module docstring)."""
    env = os.environ if environ is None else environ
    uid = os.getuid() if uid is None else uid
    if env.get("RUNTIME_DIRECTORY"):
        # systemd may list several directories separated by ':'; the first is ours.
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0])
    if uid == 0:
        return Path(ROOT_RUNTIME_DIR)
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "pkgd"
    return Path(f"/tmp/pkgd-{uid}")


def resolve_runtime_dir(configured: str | None, environ: dict[str, str] | None = None) -> Path:
    """``configured`` (``supervisor.runtime_dir``) or the default; absolute, not created."""
    return Path(configured).expanduser().absolute() if configured else default_runtime_dir(environ)


class RuntimeDir:
    """A created, private, locked runtime directory and the files the supervisor keeps in it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_fd: int | None = None
        self._dir_fd: int | None = None

    @property
    def control_socket(self) -> Path:
        return self.path / CONTROL_SOCKET

    def engine_ipc_address(self, generation: int, rank: int) -> str:
        """ZeroMQ ``ipc://`` address of engine core ``rank`` of engine generation ``generation``.

        The generation is part of the name so a reload can run old and new engine cores side
        by side; a restarted core reuses its predecessor's address so clients reconnect.
        """
        return f"ipc://{self.path}/engine-{generation}-{rank}.sock"

    def metrics_dir(self, generation: int) -> Path:
        """``PROMETHEUS_MULTIPROC_DIR`` of the API servers (created empty on first use)."""
        return self.path / f"metrics-{generation}"

    def acquire(self) -> None:
        """Create the directory (0700) without following symlinks, check it is ours and
        private, lock it and remove what a dead daemon left.

        Raises `RuntimeDirError` with a message naming the directory and the fix.
        """
        longest = len(str(self.path / "engine-999-999.sock").encode())
        if longest > SUN_PATH_MAX:
            raise RuntimeDirError(
                f"supervisor.runtime_dir: {self.path} is too long for Unix socket paths "
                f"({longest} > {SUN_PATH_MAX} bytes); choose a shorter directory"
            )
        fd = self._open_private_dir()
        try:
            self._lock(fd)
        except BaseException:
            os.close(fd)
            raise
        self._dir_fd = fd
        self._remove_stale()

    def _open_private_dir(self) -> int:
        where = f"supervisor.runtime_dir: {self.path}"
        try:
            self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            parent = os.stat(self.path.parent)
            try:
                os.mkdir(self.path, 0o700)  # never follows a symlink: an existing link is EEXIST
            except FileExistsError:
                pass
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and self.path.is_symlink():
                raise RuntimeDirError(
                    f"{where} is a symbolic link; refusing to use it (remove it, or choose another directory)"
                ) from exc
            if exc.errno == errno.ENOTDIR:
                raise RuntimeDirError(
                    f"{where} exists and is not a directory; remove it or choose another directory"
                ) from exc
            raise RuntimeDirError(f"{where}: cannot create or open it: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                raise RuntimeDirError(
                    f"{where} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}); "
                    "remove it or choose another directory"
                )
            mode = stat.S_IMODE(st.st_mode)
            if mode & 0o022:
                raise RuntimeDirError(
                    f"{where} is writable by group or others (mode {mode:04o}), so its files cannot be "
                    "trusted; remove it (pkgd creates it 0700) or chmod 700 it"
                )
            if parent.st_mode & stat.S_IWOTH and not parent.st_mode & stat.S_ISVTX:
                raise RuntimeDirError(
                    f"{where}: its parent {self.path.parent} is writable by anyone and not sticky; choose "
                    "another directory"
                )
            if mode & 0o077:
                os.fchmod(fd, 0o700)  # through the descriptor: no path to race
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _lock(self, dir_fd: int) -> None:
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RuntimeDirError(
                f"supervisor.runtime_dir: {self.path} is in use by another pkgd (pid {holder}); "
                "stop it or give this instance its own supervisor.runtime_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def make_metrics_dir(self, generation: int) -> Path:
        """Create `metrics_dir` (0700) inside the locked directory."""
        assert self._dir_fd is not None
        os.mkdir(self.metrics_dir(generation).name, 0o700, dir_fd=self._dir_fd)
        return self.metrics_dir(generation)

    def _remove_stale(self) -> None:
        """Remove what a previous daemon that died without cleaning up left behind."""
        fd = self._dir_fd
        assert fd is not None
        for entry in os.scandir(fd):
            name = entry.name
            if name.startswith("metrics-") and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(name, ignore_errors=True, dir_fd=fd)
            elif (
                (name.startswith("engine-") and name.endswith(".sock")) or name in STALE_FILES or name == CONTROL_SOCKET
            ):
                try:
                    os.unlink(name, dir_fd=fd)
                except FileNotFoundError:
                    pass

    def release(self) -> None:
        """Remove the sockets and metrics, then drop the lock (if held: the files of another
        daemon that holds the directory are left alone)."""
        if self._lock_fd is None:
            return
        self._remove_stale()
        assert self._dir_fd is not None
        try:
            os.unlink(LOCK_FILE, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        os.close(self._lock_fd)
        os.close(self._dir_fd)
        self._lock_fd = self._dir_fd = None

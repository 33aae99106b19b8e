"""The runtime directory: where the IPC sockets, the control socket and the lock live.

Resolution order (first that applies): ``supervisor.runtime_dir``; ``$RUNTIME_DIRECTORY``
(systemd's ``RuntimeDirectory=``, e.g. ``/run/pkgd``); ``/run/pkgd`` for root; for anyone else
``$XDG_RUNTIME_DIR/pkgd``, then ``/tmp/pkgd-<uid>``.

The control socket accepts commands and the engine sockets carry requests, so the directory
must be private to the daemon's user, and it is reached, created and checked without following
a symlink someone else controls (a root daemon must not be steered into chmodding, emptying and
writing a directory someone else chose). The path is walked one component at a time from ``/``
with ``openat`` and ``O_NOFOLLOW``, each step relative to the directory opened before it, and a
missing parent is created there (0755). A symlink on the way is followed only if nobody but
root and this user could have made or replaced it: it belongs to root or this user, and so
does every directory above it, none of them writable by group or others unless sticky
(``/var/run`` → ``/run`` passes; a link in ``/tmp``'s subdirectory of another user does not);
anything else is refused, naming the link. The last component is created with ``mkdirat``
(which never follows a link) and opened with ``O_NOFOLLOW | O_DIRECTORY`` (a symlink there is
always refused), and owner and mode are checked on that open directory (``fstat``): it must
belong to this user and not be writable by group or others (a mode that only lets others read
it is tightened to 0700 through the descriptor), and its parent must not be writable by others
unless sticky (``/tmp``), so nobody can swap it. Anything else is refused with a message naming
the directory. Files inside are opened relative to the directory's descriptor. The
configuration is not kept here at all: children receive it over a pipe
(`pkgd.ipc.config_channel`).

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
MAX_SYMLINKS = 40  # as Linux: more links on one path is a loop
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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
        parent_fd = _open_parent(self.path, where)
        name = self.path.name
        try:
            parent = os.fstat(parent_fd)
            try:
                os.mkdir(name, 0o700, dir_fd=parent_fd)  # never follows a symlink: an existing link is EEXIST
            except FileExistsError:
                pass
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(name, parent_fd):
                raise RuntimeDirError(
                    f"{where} is a symbolic link; refusing to use it (remove it, or choose another directory)"
                ) from exc
            if exc.errno == errno.ENOTDIR:
                raise RuntimeDirError(
                    f"{where} exists and is not a directory; remove it or choose another directory"
                ) from exc
            raise RuntimeDirError(f"{where}: cannot create or open it: {exc.strerror}") from exc
        finally:
            os.close(parent_fd)
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


def _open_parent(path: Path, where: str) -> int:
    """A descriptor of ``path``'s parent directory, reached from ``/`` one component at a time
    without following a symlink another user could have planted, missing directories created
    (0755) on the way.

    Raises:
        RuntimeDirError: a component is such a symlink (named, with the reason), is not a
            directory, or cannot be created or opened; or the links loop.
    """
    uid = os.getuid()
    todo = list(path.parent.parts[1:])
    here, fd = Path("/"), os.open("/", _DIR_FLAGS)
    suspect = _changeable_by_others(here, os.fstat(fd), uid)  # why a link below cannot be trusted
    links = 0
    try:
        while todo:
            name = todo.pop(0)
            component = here / name
            try:
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    try:
                        os.mkdir(name, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass  # made meanwhile: looked at below like any other
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    target = os.readlink(name, dir_fd=fd)
                    why = f"it belongs to uid {st.st_uid}" if st.st_uid not in (0, uid) else suspect
                    if why:
                        raise RuntimeDirError(
                            f"{where}: {component} is a symbolic link (to {target}) that another user could have "
                            f"made or changed ({why}); refusing to follow it: name a path without it, or choose "
                            "another directory"
                        )
                    links += 1
                    if links > MAX_SYMLINKS:
                        raise RuntimeDirError(f"{where}: too many levels of symbolic links at {component}")
                    todo[:0] = Path(target).parts
                    if os.path.isabs(target):
                        todo.pop(0)
                        root = os.open("/", _DIR_FLAGS)
                        os.close(fd)
                        here, fd = Path("/"), root
                        suspect = _changeable_by_others(here, os.fstat(fd), uid)
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    raise RuntimeDirError(f"{where}: {component} is not a directory; choose another directory")
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise RuntimeDirError(f"{where}: cannot create or open {component}: {exc.strerror}") from exc
            os.close(fd)
            fd, here = child, component
            suspect = suspect or _changeable_by_others(here, os.fstat(fd), uid)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _changeable_by_others(path: Path, st: os.stat_result, uid: int) -> str | None:
    """Why a user other than root and ``uid`` could rename or replace entries of directory
    ``path`` (it is theirs, or they may write it and it is not sticky), or None."""
    if st.st_uid not in (0, uid):
        return f"{path} belongs to uid {st.st_uid}"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"{path} is writable by {'others' if st.st_mode & 0o002 else 'its group'} and not sticky"
    return None


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False

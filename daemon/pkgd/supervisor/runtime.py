"""The runtime directory: where the config file, IPC sockets and the control socket live.

Resolution order (first that applies): ``supervisor.runtime_dir``; ``$RUNTIME_DIRECTORY``
(systemd's ``RuntimeDirectory=``, e.g. ``/run/pkgd``); ``$XDG_RUNTIME_DIR/pkgd``;
``/tmp/pkgd-<uid>``. The directory is created with mode 0700 and must belong to this user,
since ``config.json`` holds secrets (API keys) and the control socket accepts commands.

One daemon per runtime directory: `RuntimeDir.acquire` takes an exclusive ``flock`` on
``pkgd.lock`` and fails with a clear message when another pkgd holds it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pkgd.config.vllm_config import VllmConfig

CONFIG_FILE = "config.json"
CONTROL_SOCKET = "control.sock"
LOCK_FILE = "pkgd.lock"
SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes on Linux, NUL included


class RuntimeDirError(Exception):
    """The runtime directory is unusable (permissions, owner, or another pkgd uses it)."""


def default_runtime_dir(environ: dict[str, str] | None = None) -> Path:
    """The runtime directory when ``supervisor.runtime_dir`` is null (see module docstring)."""
    env = os.environ if environ is None else environ
    if env.get("RUNTIME_DIRECTORY"):
        # systemd may list several directories separated by ':'; the first is ours.
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "pkgd"
    return Path(f"/tmp/pkgd-{os.getuid()}")


def resolve_runtime_dir(configured: str | None, environ: dict[str, str] | None = None) -> Path:
    """``configured`` (``supervisor.runtime_dir``) or the default; absolute, not created."""
    return Path(configured).expanduser().absolute() if configured else default_runtime_dir(environ)


class RuntimeDir:
    """A created, private, locked runtime directory and the files the supervisor keeps in it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_fd: int | None = None

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

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
        """Create the directory (0700), check it is ours and private, and lock it.

        Raises `RuntimeDirError` with a message naming the directory and the fix.
        """
        longest = len(str(self.path / "engine-999-999.sock").encode())
        if longest > SUN_PATH_MAX:
            raise RuntimeDirError(
                f"supervisor.runtime_dir: {self.path} is too long for Unix socket paths "
                f"({longest} > {SUN_PATH_MAX} bytes); choose a shorter directory"
            )
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = self.path.stat()
        except OSError as exc:
            raise RuntimeDirError(f"supervisor.runtime_dir: cannot create {self.path}: {exc.strerror}") from exc
        if st.st_uid != os.getuid():
            raise RuntimeDirError(
                f"supervisor.runtime_dir: {self.path} belongs to uid {st.st_uid}, not to this user "
                f"(uid {os.getuid()}); choose another directory"
            )
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(self.path, 0o700)
        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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
        self._remove_stale()

    def _remove_stale(self) -> None:
        """Remove what a previous daemon that died without cleaning up left behind."""
        for entry in self.path.iterdir():
            if entry.name.startswith("metrics-") and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name.startswith("engine-") and entry.name.endswith(".sock"):
                entry.unlink(missing_ok=True)
        self.control_socket.unlink(missing_ok=True)

    def write_config(self, config: VllmConfig) -> Path:
        """Atomically replace ``config.json`` (mode 0600) with the config, secrets revealed.

        Children read it with ``VllmConfig.model_validate(json.load(...))``.
        """
        data = json.dumps(config.to_json_dict(reveal_secrets=True), indent=1, sort_keys=True)
        tmp = self.path / f".{CONFIG_FILE}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.config_file)
        return self.config_file

    def release(self) -> None:
        """Remove the secrets file, sockets and metrics, then drop the lock (if held: the
        files of another daemon that holds the directory are left alone)."""
        if self._lock_fd is None:
            return
        self.config_file.unlink(missing_ok=True)
        self._remove_stale()
        (self.path / LOCK_FILE).unlink(missing_ok=True)
        os.close(self._lock_fd)
        self._lock_fd = None

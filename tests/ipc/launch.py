"""Start real pkgd child processes the way the supervisor does (child-process contract):
``subprocess.Popen([sys.executable, ...], pass_fds=...)`` with a ``--ready-fd`` pipe and the
config in ``config.json``; read the one ready frame back.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pkgd.config.vllm_config import VllmConfig
from pkgd.ipc.messages import ReadyMessage, decode_ready

FAKE_ENGINE = str(Path(__file__).with_name("fake_engine.py"))


def write_config(runtime_dir: Path, config: VllmConfig | None = None) -> Path:
    runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = runtime_dir / "config.json"
    path.write_text(json.dumps((config or VllmConfig()).to_json_dict(reveal_secrets=True)))
    path.chmod(0o600)
    return path


@dataclass
class Child:
    proc: subprocess.Popen
    ready_fd: int
    ready: ReadyMessage | None = None
    extra: dict = field(default_factory=dict)

    def wait_ready(self, timeout: float = 120.0) -> ReadyMessage:
        """Read the ready pipe to EOF (one frame) and decode it."""
        data = b""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"child {self.proc.args} sent no ready frame in {timeout} s")
            r, _, _ = select.select([self.ready_fd], [], [], left)
            if not r:
                continue
            chunk = os.read(self.ready_fd, 65536)
            if not chunk:
                break
            data += chunk
        os.close(self.ready_fd)
        if not data:
            raise RuntimeError(f"child exited without a ready frame (status {self.proc.wait(10)})")
        self.ready = decode_ready(data)
        return self.ready

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def spawn(argv: list[str], extra_args: list[str], *, pass_fds: tuple[int, ...] = (), env: dict | None = None) -> Child:
    r, w = os.pipe()
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.Popen(
        [sys.executable, *argv, "--ready-fd", str(w), *extra_args],
        pass_fds=(w, *pass_fds),
        env=full_env,
    )
    os.close(w)
    return Child(proc, r)


def spawn_engine(
    config_file: Path, address: str, index: int = 0, *, fake: bool = True, env: dict | None = None
) -> Child:
    argv = [FAKE_ENGINE] if fake else ["-m", "pkgd.engine.core_proc"]
    args = ["--config-file", str(config_file), "--engine-index", str(index), "--address", address]
    return spawn(argv, args, env=env)


def listen_socket(host: str = "127.0.0.1") -> socket.socket:
    """A bound, listening TCP socket on a free port (what the supervisor hands API servers)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def spawn_api_server(
    config_file: Path, listen: socket.socket, addresses: list[str], index: int = 0, *, env: dict | None = None
) -> Child:
    args = ["--config-file", str(config_file), "--listen-fd", str(listen.fileno()), "--server-index", str(index)]
    for address in addresses:
        args += ["--engine-address", address]
    return spawn(["-m", "pkgd.api.server"], args, pass_fds=(listen.fileno(),), env=env)

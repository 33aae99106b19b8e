"""The gateway overlay's `smg launch` arguments, run for real: smg discovers pkgd pods through
a Kubernetes API (a small fake on loopback serving list and watch of pods, as kube-rs asks
for them) and routes the openai client's chat to two real pkgd daemons standing in for the
pods (each on its own loopback "pod IP", the same port, as pods do). Only the listen
addresses and the namespace are changed; selector, discovery port, policy and health check
come from the rendered manifest. Slow: two daemons load SmolLM2."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tests.deploy.test_kubernetes import needs_kustomize, one, render
from tests.supervisor.supervisor_helpers import Daemon

SMG = Path(sys.executable).with_name("smg")
pytestmark = [
    pytest.mark.slow,
    needs_kustomize,
    pytest.mark.skipif(not SMG.exists(), reason="smg is not installed (pip install smg)"),
]
NAMESPACE = "llm"


def pod(name: str, ip: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": name, "resourceVersion": "1", "labels": labels},
        "spec": {"containers": [{"name": "pkgd", "image": "pkgd:0.1.0"}]},
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


class FakeKubernetes:
    """GET /api/v1/namespaces/NS/pods: the list (label selector applied), and ?watch=true: a
    chunked stream of the events put on `events` (bookmarks meanwhile)."""

    def __init__(self, pods: list[dict]) -> None:
        self.pods, self.events, self.requests = pods, queue.Queue(), []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                outer.requests.append(self.path)
                if not self.path.startswith(f"/api/v1/namespaces/{NAMESPACE}/pods"):
                    self.send_error(404)
                    return
                if "watch=true" in self.path:
                    self._watch()
                    return
                query = dict(p.split("=", 1) for p in self.path.split("?", 1)[1].split("&") if "=" in p)
                wanted = dict(s.split("=") for s in httpx.QueryParams(f"s={query['labelSelector']}")["s"].split(","))
                items = [p for p in outer.pods if wanted.items() <= p["metadata"]["labels"].items()]
                body = json.dumps(
                    {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": items}
                )
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def _watch(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                bookmark = {
                    "type": "BOOKMARK",
                    "object": {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}},
                }
                try:
                    while True:
                        try:
                            event = outer.events.get(timeout=2)
                        except queue.Empty:
                            event = bookmark
                        data = (json.dumps(event) + "\n").encode()
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                        self.wfile.flush()
                except OSError:
                    return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def free_port(*hosts: str) -> int:
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        try:
            for host in hosts[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no common free port")


def wait_for(predicate, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_smg_with_the_overlays_arguments_discovers_pkgd_pods_and_routes_chat(tmp_path):
    objects = render("overlays/gateway")
    labels = one(objects, "Deployment", "pkgd")["spec"]["template"]["metadata"]["labels"]
    (smg,) = one(objects, "Deployment", "pkgd-gateway")["spec"]["template"]["spec"]["containers"]
    ips = ["127.0.0.2", "127.0.0.3"]
    port = free_port(*ips)
    gateway, probes, metrics = (free_port("127.0.0.1") for _ in range(3))
    rewrite = {
        "--host": "127.0.0.1",
        "--port": str(gateway),
        "--health-check-port": str(probes),
        "--prometheus-host": "127.0.0.1",
        "--prometheus-port": str(metrics),
        "--service-discovery-port": str(port),
    }
    args = [f"{a.split('=')[0]}={rewrite[a.split('=')[0]]}" if a.split("=")[0] in rewrite else a for a in smg["args"]]
    args = [a.replace("$(POD_NAMESPACE)", NAMESPACE) for a in args]
    assert f"--service-discovery-port={port}" in args and "--policy=cache_aware" in args

    daemons: list[Daemon] = []
    api = FakeKubernetes(
        [pod(f"pkgd-{i}", ip, labels) for i, ip in enumerate(ips)]
        + [pod("unrelated", "127.0.0.9", {"app.kubernetes.io/name": "pkgd"})]  # not a server: not selected
    )
    proc = None
    try:
        for i, ip in enumerate(ips):
            (tmp_path / f"d{i}").mkdir()
            config = {
                "frontend": {"host": ip, "port": port},
                # quantization none: the dequantized float path, whose greedy answer (Paris) the
                # assertion expects; the quantized path is tested in its own tests
                "model": {"max_model_len": 1024, "quantization": "none"},
                "cache": {"kv_cache_memory_bytes": 64 << 20},
                "supervisor": {"engine_ready_timeout": 300},
            }
            daemons.append(Daemon(tmp_path / f"d{i}", config, real=True))
        for d in daemons:
            d.wait_ready(300)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
                    "users": [{"name": "gateway", "user": {"token": "unused"}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "gateway"}}],
                    "current-context": "fake",
                }
            )
        )
        exe = str(SMG)
        log = (tmp_path / "smg.log").open("w")
        proc = subprocess.Popen([exe, *args], env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=log, stderr=log)
        ready = wait_for(
            lambda: (
                (r := httpx.get(f"http://127.0.0.1:{probes}/readiness", timeout=5)).status_code == 200
                and r.json()["healthy_workers"] == 2
                and r.json()
            ),
            180,
            "smg to find both pods",
        )
        assert ready["total_workers"] == 2
        workers = httpx.get(f"http://127.0.0.1:{gateway}/workers", timeout=10).json()["workers"]
        assert sorted(w["url"] for w in workers) == [f"http://{ip}:{port}" for ip in ips]
        # smg asked for exactly the overlay's selector (in any order: it keeps the labels in a map)
        asked = {frozenset(httpx.URL(r).params["labelSelector"].split(",")) for r in api.requests}
        selector = args[args.index("--selector") + 1 : args.index("--selector") + 3]
        assert asked == {frozenset(selector)}

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="unused", max_retries=0, timeout=120)
        (model,) = [m.id for m in client.models.list().data]
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=12,
        )
        assert "Paris" in (reply.choices[0].message.content or "")

        # the pod goes away (scale-down, eviction): the watch says so and smg stops routing there
        gone = {
            **pod("pkgd-1", ips[1], labels),
            "metadata": {**pod("pkgd-1", ips[1], labels)["metadata"], "resourceVersion": "2"},
        }
        api.events.put({"type": "DELETED", "object": gone})
        wait_for(
            lambda: (
                [w["url"] for w in httpx.get(f"http://127.0.0.1:{gateway}/workers", timeout=10).json()["workers"]]
                == [f"http://{ips[0]}:{port}"]
            ),
            60,
            "smg to drop the deleted pod",
        )
        for _ in range(3):
            assert (
                client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=4
                )
                .choices[0]
                .message.content
            )
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(30)
        api.close()
        for d in daemons:
            d.cleanup()

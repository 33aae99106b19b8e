"""deploy/kubernetes: every kustomization renders (kubectl kustomize) and every object it
renders validates offline against the Kubernetes 1.30 API schemas (kubernetes-validate,
strict: unknown fields are errors). The ServiceMonitor CRD has no schema there; it is checked
structurally against the Service it selects. Then what the manifests promise pkgd: the
ConfigMap's conf.d composes (`pkgd config validate`, and with the pod's environment), probe
paths are pkgd routes, paths in the config lie on the mounted volumes, the grace period
covers the drain, the gateway's flags are smg's, and the data-parallel start script gives
pkgd the multi-node flags its topology expects."""

from __future__ import annotations

import math
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pkgd.config.compose import ComposeRequest, compose
from pkgd.supervisor.retire import API_STOP_EXTRA
from pkgd.supervisor.supervisor import ENGINE_STOP_GRACE

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "deploy" / "kubernetes"
KUSTOMIZATIONS = ["base", "overlays/gateway", "overlays/data-parallel"]
KUBERNETES_VERSION = "1.30"  # the oldest release the manifests target (pod-index label: 1.28+)
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def _kustomize() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


needs_kustomize = pytest.mark.skipif(_kustomize() is None, reason="neither kubectl nor kustomize is installed")

_rendered: dict[str, list[dict[str, Any]]] = {}


def render(name: str) -> list[dict[str, Any]]:
    if name not in _rendered:
        cmd = _kustomize()
        assert cmd is not None
        r = subprocess.run([*cmd, str(KUBE / name)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        _rendered[name] = [doc for doc in yaml.safe_load_all(r.stdout) if doc]
    return _rendered[name]


def one(objects: list[dict], kind: str, name: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def pkgd_container(workload: dict) -> dict:
    (c,) = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == "pkgd"]
    return c


def pkgd_workloads(objects: list[dict]) -> list[dict]:
    return [w for w in workloads(objects) if w["metadata"]["labels"].get("app.kubernetes.io/name") == "pkgd"]


def conf_d_tree(objects: list[dict], tmp_path: Path) -> Path:
    """The ConfigMap's files as a system tree (ROOT/conf.d/*.yaml), as the pods mount it."""
    data = one(objects, "ConfigMap", "pkgd-conf-d")["data"]
    (tmp_path / "conf.d").mkdir(parents=True)
    for key, text in data.items():
        (tmp_path / "conf.d" / key).write_text(text)
    return tmp_path


def pod_env(container: dict, **field_refs: str) -> dict[str, str]:
    """The container's PKGD_ variables as a pod would see them: literal values, limits.cpu
    rounded up (the divisor 1 of the downward API), field references from ``field_refs``."""
    env = {}
    for var in container.get("env", []):
        source = var.get("valueFrom", {})
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "resourceFieldRef" in source:
            limit = container["resources"]["limits"][source["resourceFieldRef"]["resource"].split(".")[1]]
            env[var["name"]] = str(math.ceil(float(limit[:-1]) / 1000 if limit.endswith("m") else float(limit)))
        elif "fieldRef" in source:
            env[var["name"]] = field_refs[source["fieldRef"]["fieldPath"]]
    return {k: v for k, v in env.items() if k.startswith("PKGD_")}


@needs_kustomize
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_rendered_object_validates_against_the_kubernetes_schemas(name):
    import kubernetes_validate

    objects = render(name)
    assert objects
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CRDS:
            continue  # no schema in kubernetes-validate; test_service_monitors_select_a_service
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_a_broken_object_fails_the_validation():
    """The check above can fail: a misspelt field and a wrong type are errors."""
    import kubernetes_validate

    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"portz": []}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "x"}, "spec": {"accessModes": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pvc, KUBERNETES_VERSION, strict=True)


@needs_kustomize
def test_each_kustomization_has_what_it_promises():
    kinds = {name: sorted({o["kind"] for o in render(name)}) for name in KUSTOMIZATIONS}
    assert kinds["base"] == ["ConfigMap", "Deployment", "PersistentVolumeClaim", "Service", "ServiceAccount"]
    assert kinds["overlays/gateway"] == [
        "ConfigMap",
        "Deployment",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
        "ServiceMonitor",
    ]
    assert kinds["overlays/data-parallel"] == ["ConfigMap", "NetworkPolicy", "Service", "ServiceAccount", "StatefulSet"]
    assert one(render("base"), "Deployment", "pkgd")["spec"]["replicas"] == 1


@needs_kustomize
def test_service_monitors_select_a_service_and_its_port():
    objects = render("overlays/gateway")
    monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert len(monitors) == 2
    for monitor in monitors:
        spec = monitor["spec"]
        assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
        services = [
            s
            for s in objects
            if s["kind"] == "Service"
            and spec["selector"]["matchLabels"].items() <= s["metadata"].get("labels", {}).items()
        ]
        assert services, monitor["metadata"]["name"]
        for endpoint in spec["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
            assert re.fullmatch(r"\d+[sm]", endpoint["interval"])
            for service in services:
                assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


@needs_kustomize
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_conf_d_passes_pkgd_config_validate(name, tmp_path):
    root = conf_d_tree(render(name), tmp_path)
    pkgd = [sys.executable, "-m", "pkgd.cli.main"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PKGD_", "VLLM_"))}
    r = subprocess.run([*pkgd, "config", "validate", str(root)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    (root / "conf.d" / "99-typo.yaml").write_text("supervisor: {watch_confg: true}\n")  # the CI step can fail
    r = subprocess.run([*pkgd, "config", "validate", str(root)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "supervisor.watch_confg" in r.stdout + r.stderr


def test_the_ci_command_of_the_docs_validates_the_component():
    """docs/kubernetes.md's CI step: `pkgd config validate deploy/kubernetes/components/common`."""
    assert "config validate /cfg" in (REPO / "docs" / "kubernetes.md").read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PKGD_", "VLLM_"))}
    cmd = [sys.executable, "-m", "pkgd.cli.main", "config", "validate", str(KUBE / "components" / "common")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_kustomize
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_pods_config_watches_its_configmap_and_threads_follow_the_cpu_limit(name, tmp_path):
    objects = render(name)
    root = conf_d_tree(objects, tmp_path)
    for workload in pkgd_workloads(objects):
        container = pkgd_container(workload)
        env = pod_env(
            container,
            **{"status.podIP": "10.0.0.7", "metadata.labels['apps.kubernetes.io/pod-index']": "1"},
        )
        config = compose(ComposeRequest(config_dir=str(root), env=env)).config
        assert config.supervisor.watch_config
        limit = container["resources"]["limits"]["cpu"]
        assert config.parallel.cpu_threads == math.ceil(float(limit))
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        volumes.update({t["metadata"]["name"]: t for t in workload["spec"].get("volumeClaimTemplates", [])})
        conf_d = mounts["/etc/pkgd/conf.d"]
        assert "subPath" not in conf_d and volumes[conf_d["name"]]["configMap"]["name"] == "pkgd-conf-d"

        def volume_of(path: str) -> dict:
            mount = max((m for m in mounts if path == m or path.startswith(m + "/")), key=len)
            return mounts[mount]

        assert volume_of(config.model.source)["readOnly"]
        for writable in (config.model.cache_dir, config.supervisor.runtime_dir):
            assert writable is not None and not volume_of(writable).get("readOnly")
            assert "emptyDir" in volumes[volume_of(writable)["name"]]


@needs_kustomize
def test_runtime_dir_below_an_emptydir_is_accepted(tmp_path):
    """The kubelet creates an emptyDir 0777; pkgd refuses a runtime directory whose parent is
    writable by anyone, so the config puts it one level below a directory pkgd creates."""
    from pkgd.supervisor.runtime import RuntimeDir, RuntimeDirError

    config = compose(ComposeRequest(config_dir=str(conf_d_tree(render("base"), tmp_path)), env={})).config
    mount = next(
        m["mountPath"] for m in pkgd_container(workloads(render("base"))[0])["volumeMounts"] if m["name"] == "run"
    )
    relative = Path(config.supervisor.runtime_dir).relative_to(mount)
    emptydir = tmp_path / "emptydir"
    emptydir.mkdir()
    emptydir.chmod(0o777)
    runtime = RuntimeDir(emptydir / relative)
    runtime.acquire()
    runtime.release()
    assert stat.S_IMODE((emptydir / relative).stat().st_mode) == 0o700
    with pytest.raises(RuntimeDirError, match="writable by anyone"):
        RuntimeDir(emptydir / "rt").acquire()  # directly in the emptyDir: refused


def _routes() -> set[str]:
    from pkgd.api.routes import router
    from pkgd.api.routes_admin import router as admin

    return {route.path for r in (router, admin) for route in r.routes}


@needs_kustomize
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_probes_use_pkgd_routes_and_the_pods_are_locked_down(name):
    routes = _routes()
    for workload in workloads(render(name)):
        spec = workload["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] != 0
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
            assert {"cpu", "memory"} <= c["resources"]["requests"].keys() <= c["resources"]["limits"].keys()
        if workload["metadata"]["labels"]["app.kubernetes.io/name"] != "pkgd":
            continue
        c = pkgd_container(workload)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = c[probe]
            paths = (
                [p["httpGet"]["path"]]
                if "httpGet" in p
                else re.findall(r"127\.0\.0\.1:8000(/\w+)", p["exec"]["command"][-1])
            )
            assert paths and set(paths) <= routes, (probe, paths)
        sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        drain = 30.0  # components/common/conf.d/10-serve.yaml, asserted below
        assert "drain_timeout: 30\n" in (KUBE / "components/common/conf.d/10-serve.yaml").read_text()
        assert spec["terminationGracePeriodSeconds"] > sleep + drain + API_STOP_EXTRA + ENGINE_STOP_GRACE


@needs_kustomize
def test_hpa_scales_on_a_metric_pkgd_exports_through_the_documented_adapter_rule():
    hpa = one(render("overlays/gateway"), "HorizontalPodAutoscaler", "pkgd")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    rules = yaml.safe_load((KUBE / "overlays/gateway/prometheus-adapter-rules.yaml").read_text())
    (rule,) = rules["rules"]["custom"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    assert re.match(rule["name"]["matches"], "vllm:num_requests_waiting")
    from pkgd.frontend import metrics

    assert "num_requests_waiting" in Path(metrics.__file__).read_text()  # served as vllm:num_requests_waiting
    assert hpa["spec"]["scaleTargetRef"]["name"] == "pkgd"


@needs_kustomize
def test_gateway_flags_are_smgs_and_discovery_matches_the_pods():
    objects = render("overlays/gateway")
    gateway = one(objects, "Deployment", "pkgd-gateway")
    (c,) = gateway["spec"]["template"]["spec"]["containers"]
    args = c["args"]
    selector = args[args.index("--selector") + 1 : args.index("--selector") + 3]
    pod_labels = one(objects, "Deployment", "pkgd")["spec"]["template"]["metadata"]["labels"]
    assert dict(s.split("=") for s in selector).items() <= pod_labels.items()
    assert "--policy=cache_aware" in args and "--service-discovery" in args
    assert "--service-discovery-port=8000" in args
    role = one(objects, "Role", "pkgd-gateway-discovery")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert gateway["spec"]["template"]["spec"]["serviceAccountName"] == "pkgd-gateway"
    smg = Path(sys.executable).with_name("smg")
    if not smg.exists():
        pytest.skip("smg is not installed: its flags are not checked")
    help_text = subprocess.run([str(smg), "launch", "--help"], capture_output=True, text=True, timeout=60).stdout
    for flag in (a.split("=")[0] for a in args if a.startswith("--")):
        assert re.search(rf"\s{re.escape(flag)}[\s,\]]", help_text), flag
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] == "probes" and "--health-check-port=30001" in args


def _start_script(rank: str, tmp_path: Path) -> list[str]:
    """Run the StatefulSet's command with a ``pkgd`` that prints its arguments."""
    sts = one(render("overlays/data-parallel"), "StatefulSet", "pkgd-dp")
    c = pkgd_container(sts)
    fake = tmp_path / "bin" / "pkgd"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    env = pod_env(c, **{"status.podIP": "10.0.0.7", "metadata.labels['apps.kubernetes.io/pod-index']": rank})
    env.update(PATH=f"{fake.parent}:/usr/bin:/bin", POD_IP="10.0.0.7")
    r = subprocess.run(c["command"], capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


@needs_kustomize
def test_data_parallel_ranks_get_pkgds_multi_node_flags(tmp_path):
    from pkgd.supervisor.runtime import RuntimeDir
    from pkgd.supervisor.topology import engine_address, local_ranks

    objects = render("overlays/data-parallel")
    sts = one(objects, "StatefulSet", "pkgd-dp")
    assert sts["spec"]["serviceName"] == "pkgd-dp" and one(objects, "Service", "pkgd-dp")["spec"]["clusterIP"] == "None"
    root = conf_d_tree(objects, tmp_path / "etc")
    head = _start_script("0", tmp_path)
    assert head[:3] == ["serve", "--config-dir", "/etc/pkgd"]
    other = _start_script("1", tmp_path)
    assert other == ["serve", "--config-dir", "/etc/pkgd", "--headless", "--data-parallel-address", "10.0.0.7"]

    env = pod_env(pkgd_container(sts), **{"metadata.labels['apps.kubernetes.io/pod-index']": "1", "status.podIP": "x"})
    worker = compose(ComposeRequest(config_dir=str(root), flags=tuple(other[3:]), env=env)).config
    plan = worker.serve_plan()
    assert plan.mode == "headless" and list(local_ranks(plan)) == [1]
    listens = engine_address(worker, plan, RuntimeDir(tmp_path), 0, 1)
    assert listens == "tcp://10.0.0.7:13346"

    env["PKGD_PARALLEL__NODE_RANK"] = "0"
    leader = compose(ComposeRequest(config_dir=str(root), flags=tuple(head[3:]), env=env)).config
    plan = leader.serve_plan()
    assert plan.mode == "multi_api" and plan.api_server_count == 2 and list(local_ranks(plan)) == [0]
    # the head reaches rank 1 by its StatefulSet DNS name, on the port it listens on
    assert leader.parallel.remote_engines == ["tcp://pkgd-dp-1.pkgd-dp:13346"]
    assert sts["spec"]["replicas"] == leader.parallel.nnodes == leader.parallel.dp
    # only the head may reach the engine ports, every rank's among them
    policy = one(objects, "NetworkPolicy", "pkgd-dp-engines")["spec"]["ingress"][0]
    assert policy["from"][0]["podSelector"]["matchLabels"]["apps.kubernetes.io/pod-index"] == "0"
    (ports,) = policy["ports"]
    assert ports["port"] <= 13345 + 1 <= 13345 + leader.parallel.dp - 1 <= ports["endPort"]

"""`pkgd.host.available_cores`: the affinity mask capped by the cgroup CPU quota (what a
Kubernetes CPU limit sets), read from a fake cgroup tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from pkgd import host


def _v2(tmp_path: Path, cpu_max: dict[str, str]) -> tuple[str, str]:
    root = tmp_path / "cgroup"
    for rel, value in cpu_max.items():
        d = root / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.max").write_text(value + "\n")
    proc = tmp_path / "cgroup.proc"
    proc.write_text("0::/kubepods/pod1/ctr\n")
    return str(root), str(proc)


def test_v2_quota_of_the_own_cgroup(tmp_path):
    root, proc = _v2(tmp_path, {"kubepods/pod1/ctr": "150000 100000", "kubepods": "max 100000"})
    assert host.cgroup_cpu_quota(root, proc) == pytest.approx(1.5)


def test_v2_the_tightest_ancestor_bounds(tmp_path):
    root, proc = _v2(tmp_path, {"kubepods/pod1/ctr": "max 100000", "kubepods/pod1": "50000 100000"})
    assert host.cgroup_cpu_quota(root, proc) == pytest.approx(0.5)


def test_v2_unlimited_and_missing_are_none(tmp_path):
    root, proc = _v2(tmp_path, {"kubepods/pod1/ctr": "max 100000"})
    assert host.cgroup_cpu_quota(root, proc) is None
    assert host.cgroup_cpu_quota(str(tmp_path / "nothing"), str(tmp_path / "no-proc")) is None


def test_v1_cfs_quota(tmp_path):
    root = tmp_path / "cgroup"
    d = root / "cpu,cpuacct" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("200000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup.proc"
    proc.write_text("4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n")
    assert host.cgroup_cpu_quota(str(root), str(proc)) == pytest.approx(2.0)
    (d / "cpu.cfs_quota_us").write_text("-1\n")
    assert host.cgroup_cpu_quota(str(root), str(proc)) is None


@pytest.mark.parametrize("mask,quota,want", [(8, None, 8), (8, 1.5, 2), (8, 1.0, 1), (2, 4.0, 2), (4, 0.2, 1)])
def test_available_cores_is_the_mask_capped_by_the_quota_rounded_up(monkeypatch, mask, quota, want):
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: set(range(mask)))
    monkeypatch.setattr(host, "cgroup_cpu_quota", lambda: quota)
    assert host.available_cores() == want

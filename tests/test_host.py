"""Host memory within a container: the cgroup limit bounds what /proc/meminfo (the node) says."""

from __future__ import annotations

from pkgd import host

GIB = 1 << 30


def test_cgroup_v2_limit_and_usage_of_the_own_cgroup(tmp_path, monkeypatch):
    own = tmp_path / "kubepods" / "pod1" / "c1"
    own.mkdir(parents=True)
    (own / "memory.max").write_text(f"{4 * GIB}\n")
    (own / "memory.current").write_text(f"{GIB + 4096}\n")
    (own / "memory.stat").write_text("anon 1073741824\ninactive_file 4096\nactive_file 0\n")  # cache reclaimed first
    (tmp_path / "memory.max").write_text("max\n")  # the root cgroup: unlimited
    monkeypatch.setattr(host, "_own_cgroup", lambda: "/kubepods/pod1/c1")
    assert host.cgroup_memory(str(tmp_path)) == (4 * GIB, GIB)
    monkeypatch.setattr(host, "_own_cgroup", lambda: "/")  # a container's namespace: its cgroup is the root
    assert host.cgroup_memory(str(tmp_path)) == (None, None)


def test_cgroup_v1_limit_and_no_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(host, "_own_cgroup", lambda: None)
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert host.cgroup_memory(str(tmp_path)) == (None, None)
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text(f"{GIB // 2}\n")
    assert host.cgroup_memory(str(tmp_path)) == (2 * GIB, GIB // 2)


def test_available_and_total_take_the_smaller_of_node_and_limit(monkeypatch):
    monkeypatch.setattr(host, "_meminfo", lambda key: {"MemAvailable": 100 * GIB, "MemTotal": 128 * GIB}[key])
    monkeypatch.setattr(host, "cgroup_memory", lambda: (4 * GIB, 3 * GIB))
    assert host.mem_available_bytes() == GIB and host.mem_total_bytes() == 4 * GIB
    monkeypatch.setattr(host, "cgroup_memory", lambda: (4 * GIB, 5 * GIB))  # over the limit (page cache)
    assert host.mem_available_bytes() == 0
    monkeypatch.setattr(host, "cgroup_memory", lambda: (None, None))
    assert host.mem_available_bytes() == 100 * GIB and host.mem_total_bytes() == 128 * GIB

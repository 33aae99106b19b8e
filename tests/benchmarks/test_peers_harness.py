"""benchmarks/peers: the pure logic of the peers harness (no peer installed, no server started):
the CPU share of other processes from /proc readings, a prompt seed per load level, the two
clients' result files, the CPU list vLLM's thread binding takes, allocator preloads found on
disk, --quick's defaults, ports from --port-base, and the per-instance pkgd cache."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "peers"))

import clients  # noqa: E402
import cpuload  # noqa: E402
import summary  # noqa: E402
import systems  # noqa: E402

PROC_STAT = """cpu  1000 50 300 5000 100 10 20 30 40 0
cpu0 500 25 150 2500 50 5 10 15 20 0
cpu1 500 25 150 2500 50 5 10 15 20 0
intr 12345
"""


def test_proc_stat_busy_and_total_ticks():
    t = cpuload.parse_proc_stat(PROC_STAT)
    assert t.busy == 1000 + 50 + 300 + 10 + 20 + 30  # guest (40) is inside user already
    assert t.total == t.busy + 5000 + 100


def test_proc_stat_without_the_cpu_line_is_an_error():
    with pytest.raises(ValueError):
        cpuload.parse_proc_stat("cpu0 1 2 3 4\n")


def test_pid_stat_fields_after_a_command_name_with_spaces_and_parens():
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
    text = "4242 (my (odd) cmd) S 1 4242 777 0 -1 4194304 10 0 0 0 123 45 6 7 20 0 1 0 100"
    assert cpuload.parse_pid_stat(text) == (777, 123 + 45)


def test_others_share_subtracts_our_ticks_from_the_box():
    box0, box1 = cpuload.BoxTicks(busy=1000, total=4000), cpuload.BoxTicks(busy=1600, total=5000)
    # 600 busy ticks of 1000 in the window, 450 of them ours: others took 15% of the box
    assert cpuload.others_share(box0, box1, 450) == pytest.approx(0.15)
    assert cpuload.others_share(box0, box1, 700) == 0.0  # sampling skew never goes negative
    assert cpuload.others_share(box0, box0, 0) == 0.0


def test_others_sampler_counts_this_process_as_ours():
    s = cpuload.OthersSampler(set(), {os.getpid()}, interval=0.05)
    s.start()
    end = time.process_time() + 0.3
    while time.process_time() < end:  # burn CPU in this (tracked) process
        pass
    share = s.stop()
    assert 0.0 <= share <= 1.0
    assert s._last[os.getpid()] > s._first[os.getpid()]  # our ticks were seen and subtracted


def test_seeds_differ_for_every_level_client_and_phase_and_match_across_servers():
    seeds = [
        clients.level_seed(phase, client, c)
        for phase in clients.PHASES
        for client in clients.CLIENTS
        for c in (1, 2, 16, 64, 256)
    ]
    assert len(seeds) == len(set(seeds))
    assert clients.level_seed("serve", "light", 64) == clients.level_seed("serve", "light", 64)
    with pytest.raises(ValueError):
        clients.level_seed("warmup", "light", 1)


def test_levels_send_their_seed_to_each_client(tmp_path):
    level = clients.Level(64, 64, 128, 32, clients.level_seed("busy", "light", 64))
    light = clients.light_argv(Path("/v/pkgd"), "http://127.0.0.1:1", level, tmp_path / "a.json")
    assert light[light.index("--random-seed") + 1] == str(level.seed)
    vb = clients.vllm_argv(Path("/v/vllm"), "http://127.0.0.1:1", "m", tmp_path, level, tmp_path / "b.json")
    assert vb[vb.index("--seed") + 1] == str(level.seed)
    assert vb[vb.index("--result-filename") + 1] == "b.json"
    assert vb[vb.index("--max-concurrency") + 1] == "64"


def test_parse_both_clients_results():
    light = clients.parse_light(
        {
            "output_tokens_per_s": 370.0,
            "ttft_s": {"median": 3.0, "p99": 8.0},
            "tpot_s": {"median": 0.188},
            "failed": 0,
            "errors": {},
        }
    )
    assert light == clients.Figures(370.0, 3.0, 8.0, pytest.approx(188.0), 0, "")
    vb = clients.parse_vllm(
        {
            "completed": 62,
            "num_prompts": 64,
            "output_throughput": 411.0,
            "median_ttft_ms": 3380.0,
            "p99_ttft_ms": 7320.0,
            "median_tpot_ms": 135.0,
            "errors": ["", "boom"],
        }
    )
    assert (vb.tok_s, vb.ttft_med_s, vb.ttft_p99_s, vb.tpot_med_ms, vb.failed) == (411.0, 3.38, 7.32, 135.0, 2)
    assert vb.errors == "boom"


def test_cpu_list_in_kernel_format():
    assert systems.cpu_list({0, 1}) == "0-1"
    assert systems.cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert systems.cpu_list({3}) == "3"


def test_allocator_preloads_when_present_tcmalloc_first(tmp_path):
    lib = tmp_path / "venv" / "lib"
    lib.mkdir(parents=True)
    (lib / "libiomp5.so").write_bytes(b"")
    globs = (str(tmp_path / "none" / "libtcmalloc.so.4"), "{venv}/lib/libtcmalloc*.so*", "{venv}/lib/libiomp5.so")
    assert systems.allocator_preloads(tmp_path / "venv", globs) == [str(lib / "libiomp5.so")]
    (lib / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert systems.allocator_preloads(tmp_path / "venv", globs) == [
        str(lib / "libtcmalloc_minimal.so.4"),
        str(lib / "libiomp5.so"),
    ]


def test_vllm_env_binds_threads_and_sizes_the_kv_cache(tmp_path):
    p = systems.Paths(work=tmp_path, pkgd_py=tmp_path / "py", vllm_venv=tmp_path / "venv", llama_bin=tmp_path)
    env = systems.vllm_env(p)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == systems.cpu_list(os.sched_getaffinity(0))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(systems.VLLM_KVCACHE_GIB)


def test_quick_defaults_and_explicit_options_win():
    args = summary.parse_args(["--quick"])
    assert args.names == ["pkgd", "vllm-bfloat16", "llama.cpp"]
    assert args.concurrency == [1, 64] and args.clients == ["light", "vllm"]
    assert args.parts == {"offline", "serve"} and args.contention
    assert args.timeout <= 600 and args.contention_timeout <= 600
    assert "contention" in summary.METRICS and "serve64_vb_tok_s" in summary.METRICS
    args = summary.parse_args(["--quick", "--concurrency", "1", "32", "--clients", "light"])
    assert args.concurrency == [1, 32] and args.clients == ["light"]
    full = summary.parse_args([])
    assert full.concurrency == [1, 16, 64] and full.contention_prompts == 128


def test_ports_from_base_are_consecutive_and_a_taken_one_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        ports = summary.Ports(taken - 1)
        first = ports.next()
        assert first == taken - 1
        with pytest.raises(RuntimeError, match=str(taken)):
            ports.next()


def test_pkgd_instance_links_weights_but_not_measurements(tmp_path):
    weights, kernels = tmp_path / "weights", tmp_path / "kernels"
    (weights / "abc123").mkdir(parents=True)
    (weights / "abc123" / "model.safetensors").write_bytes(b"w")
    (weights / "dtype-choice").mkdir()
    (weights / "dtype-choice" / "x.json").write_text("{}")
    a = systems.PkgdInstance(tmp_path, "pkgd", weights, kernels)
    b = systems.PkgdInstance(tmp_path, "pkgd", weights, kernels)
    assert a.cache != b.cache and a.runtime != b.runtime
    assert (a.cache / "abc123" / "model.safetensors").read_bytes() == b"w"
    assert not (a.cache / "dtype-choice").exists()
    cfg = a.config()
    assert f"model.cache_dir={a.cache}" in cfg and f"supervisor.runtime_dir={a.runtime}" in cfg
    assert f"parallel.cpu_kernel_cache={kernels}" in cfg
    # what an instance measured stays its own; what it converted is shared afterwards
    (a.cache / "dtype-choice").mkdir()
    (a.cache / "def456").mkdir()
    (a.cache / "def456" / "model.safetensors").write_bytes(b"v")
    a.close()
    assert not a.cache.exists() and not a.runtime.exists()
    assert (weights / "def456" / "model.safetensors").read_bytes() == b"v"
    assert list((weights / "dtype-choice").iterdir()) == [weights / "dtype-choice" / "x.json"]
    b.close()


def test_others_lines_warn_above_ten_percent():
    lines = summary.others_lines([("pkgd", "c64 light", 0.04), ("vllm-bfloat16", "busy64 light", 0.25)])
    assert any("pkgd: c64 light 4%" in ln for ln in lines)
    warning = [ln for ln in lines if ln.startswith("WARNING")]
    assert len(warning) == 1 and "vllm-bfloat16 busy64 light (25%)" in warning[0] and "pkgd" not in warning[0]
    assert summary.others_lines([]) == []


def test_model_files_read_past_pkgd_log_lines_on_stdout(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        "echo '2026-01-01 [info] model_phase phase=convert_gguf seconds=15'\n"
        "echo 'PEERS_MODEL_DIR /c/abc'\n"
        "echo 'PEERS_GGUF /m/model.gguf'\n"
    )
    fake.chmod(0o755)
    assert systems.resolve_model_files(fake, tmp_path) == (Path("/c/abc"), Path("/m/model.gguf"))


def test_schedule_by_part_or_by_system():
    by_part = summary.schedule("part", 1, ["offline", "serve"], ["pkgd", "llama.cpp"])
    assert by_part == [
        (0, "offline", "pkgd"),
        (0, "offline", "llama.cpp"),
        (0, "serve", "pkgd"),
        (0, "serve", "llama.cpp"),
    ]
    by_sys = summary.schedule("system", 2, ["offline", "serve"], ["pkgd", "llama.cpp"])
    assert by_sys[:4] == [
        (0, "offline", "pkgd"),
        (0, "serve", "pkgd"),
        (0, "offline", "llama.cpp"),
        (0, "serve", "llama.cpp"),
    ]
    assert len(by_sys) == 8 and by_sys[4][0] == 1

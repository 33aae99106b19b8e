"""Host checks made at `pkgd serve` before any child starts (pkgd.supervisor.preflight)."""

from __future__ import annotations

from pkgd.config.vllm_config import VllmConfig
from pkgd.supervisor import preflight


def test_a_readable_template_file_and_inline_text_pass(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages }}")
    assert preflight.host_problems(VllmConfig(model={"chat_template": str(f)})) == []
    assert preflight.host_problems(VllmConfig(model={"chat_template": "{{ messages }}"})) == []
    assert preflight.host_problems(VllmConfig()) == []


def test_cuda_on_a_cpu_only_torch_is_named(monkeypatch):
    monkeypatch.setattr(preflight, "_torch_version", lambda: "2.13.0+cpu")
    (problem,) = preflight.host_problems(VllmConfig(parallel={"device": "cuda"}))
    assert problem.startswith("parallel.device: cuda") and "2.13.0+cpu" in problem
    assert preflight.host_problems(VllmConfig(parallel={"device": "auto"})) == []
    monkeypatch.setattr(preflight, "_torch_version", lambda: "2.13.0+cu128")
    assert preflight.host_problems(VllmConfig(parallel={"device": "cuda"})) == []


GIB = 1 << 30


def _kv(budget: str, **parallel: object) -> VllmConfig:
    return VllmConfig(cache={"kv_cache_memory_bytes": budget}, parallel={"device": "cpu", **parallel})


def test_a_kv_budget_beyond_the_hosts_memory_is_named_with_the_figures():
    problem = preflight.kv_cache_memory_problem(_kv("1T"), 64 * GIB, 40 * GIB)
    assert problem == (
        "cache.kv_cache_memory_bytes: 1024.0 GiB of KV cache is more than this host's 64.0 GiB of memory "
        "(MemTotal, 40.0 GiB available now), before any weights are loaded; lower cache.kv_cache_memory_bytes"
    )
    # up to all of the memory passes: what is available now is the engine core's to check
    assert preflight.kv_cache_memory_problem(_kv("64G"), 64 * GIB, 1 * GIB) is None
    assert preflight.kv_cache_memory_problem(_kv("1T"), None, None) is None  # host unknown


def test_every_local_engine_worker_takes_the_whole_budget():
    problem = preflight.kv_cache_memory_problem(_kv("20G", dp=2, tp=2), 64 * GIB, None)
    assert problem is not None and "20.0 GiB of KV cache x 4 engine workers on this node" in problem
    assert "= 80.0 GiB is more than this host's 64.0 GiB of memory (MemTotal)," in problem
    assert preflight.kv_cache_memory_problem(_kv("20G", dp=4, dp_local=1), 64 * GIB, None) is None


def test_no_kv_check_where_the_budget_is_not_host_memory():
    assert preflight.kv_cache_memory_problem(VllmConfig(), 8 * GIB, None) is None  # default budget: sized at load
    blocks = VllmConfig(cache={"kv_cache_memory_bytes": "1T", "num_blocks": 64})  # num_blocks overrides it
    assert preflight.kv_cache_memory_problem(blocks, 8 * GIB, None) is None
    cuda = VllmConfig(cache={"kv_cache_memory_bytes": "1T"}, parallel={"device": "cuda"})
    assert preflight.kv_cache_memory_problem(cuda, 8 * GIB, None) is None  # GPU memory


def test_host_problems_reads_the_hosts_memory(monkeypatch):
    monkeypatch.setattr(preflight.host, "mem_total_bytes", lambda: 8 * GIB)
    monkeypatch.setattr(preflight.host, "mem_available_bytes", lambda: 6 * GIB)
    (problem,) = preflight.host_problems(_kv("16G"))
    assert problem.startswith("cache.kv_cache_memory_bytes: 16.0 GiB") and "8.0 GiB of memory" in problem
    assert preflight.host_problems(_kv("4G")) == []


def test_a_lora_module_without_an_adapter_is_named_before_anything_loads(tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    (good / "adapter_config.json").write_text("{}")
    cfg = VllmConfig(lora={"enable_lora": True, "lora_modules": [f"ok={good}", f"gone={tmp_path / 'missing'}"]})
    assert preflight.lora_module_problems(cfg) == [
        f"lora.lora_modules.1 (gone): {tmp_path / 'missing'} holds no adapter_config.json "
        "(a PEFT LoRA adapter directory is needed)"
    ]
    assert preflight.serve_problems(cfg)[0].startswith("lora.lora_modules.1 (gone)")

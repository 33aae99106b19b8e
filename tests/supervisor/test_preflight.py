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

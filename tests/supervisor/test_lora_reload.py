"""An adapter loaded at run time survives a reload that keeps the engine: the supervisor with
the real children (SmolLM2), an adapter loaded with ``/v1/load_lora_adapter``, then a SIGHUP
whose change restarts the API servers only; the new API generation lists and serves the
adapter (it asks the engine core, which owns the adapters)."""

from __future__ import annotations

import httpx
import pytest
from supervisor_helpers import NEEDS_REAL_CHILDREN, reload_and_wait

pytestmark = [
    pytest.mark.slow,
    NEEDS_REAL_CHILDREN,
]

MODEL = "smollm2"
REAL = {
    "model": {"name": MODEL, "max_model_len": 256},
    "cache": {"kv_cache_memory_bytes": 32 << 20},
    "supervisor": {"drain_timeout": 10, "restart_backoff": 1.0, "engine_ready_timeout": 300},
    "frontend": {"allow_runtime_lora_updating": True},
    "lora": {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8},
}


def _smollm2_adapter(path):
    """A random rank-8 adapter of SmolLM2-135M's shapes (30 layers, hidden 576, 9 heads of 64,
    3 KV heads, MLP 1536)."""
    from pkgd.benchmarks.lora import write_random_adapters
    from pkgd.runner.lora.adapter import LinearShape

    shapes = {}
    for i in range(30):
        shapes[(i, "qkv_proj")] = LinearShape(576, (576, 192, 192))
        shapes[(i, "o_proj")] = LinearShape(576, (576,))
        shapes[(i, "gate_up_proj")] = LinearShape(576, (1536, 1536))
        shapes[(i, "down_proj")] = LinearShape(1536, (576,))
    (req,) = write_random_adapters(shapes, path, 1, 8)
    return req.lora_path


def _complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def test_runtime_adapter_survives_an_api_reload(start_daemon, workdir):
    path = _smollm2_adapter(workdir / "adapters")
    d = start_daemon(REAL, real=True)
    url = d.wait_ready(300)
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path}, timeout=120)
    assert r.status_code == 200, r.text
    assert _complete(url, "late").status_code == 200
    api_before = set(d.child_pids("api-server").values())
    engine_before = set(d.child_pids("engine-core").values())
    outcome = reload_and_wait(d, {"frontend": {"limits": {"max_logprobs": 19}}}, timeout=300)
    assert outcome["event"] == "reload_applied" and outcome["reload_class"] == "api", outcome
    assert set(d.child_pids("engine-core").values()) == engine_before
    assert not set(d.child_pids("api-server").values()) & api_before  # a new API generation
    models = {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]}
    assert models["late"]["parent"] == MODEL
    r = _complete(url, "late")
    assert r.status_code == 200 and r.json()["model"] == "late"

"""Models, tokenizer utilities, health/version/metrics/docs, API keys and CORS (both live:
replacing ``state.config``, as a SIGHUP reload does, takes effect on the next request)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pkgd.config.vllm_config import VllmConfig

from .conftest import served

pytestmark = pytest.mark.anyio
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


async def test_models_lists_the_served_names(tokenizer):
    cfg = VllmConfig.model_validate({"frontend": {"served_model_names": ["smol", "default"]}})
    async with served(tokenizer, config=cfg) as (http, _s, _f):
        data = (await http.get("/v1/models")).json()
        assert [m["id"] for m in data["data"]] == ["smol", "default"] and data["object"] == "list"
        assert (
            await http.post("/v1/completions", json={"model": "default", "prompt": "x", "max_tokens": 1})
        ).status_code == 200
        assert (
            await http.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "x"})
        ).status_code == 404


async def test_tokenize_and_detokenize_round_trip(tokenizer):
    async with served(tokenizer) as (http, state, _f):
        r = (await http.post("/tokenize", json={"prompt": "Hello world"})).json()
        assert r["tokens"] == tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == state.llm.input_processor.max_model_len
        back = (await http.post("/detokenize", json={"tokens": r["tokens"]})).json()
        assert back["prompt"] == "Hello world"
        chat = (await http.post("/tokenize", json={"messages": MESSAGES})).json()
        assert tokenizer.decode(chat["tokens"]) == state.llm.input_processor.render_chat(MESSAGES)


async def test_health_version_docs(tokenizer):
    async with served(tokenizer) as (http, _s, _f):
        assert (await http.get("/health")).json() == {"status": "ok"}
        assert (await http.get("/version")).json()["version"]
        assert (await http.get("/docs")).status_code == 200
        paths = (await http.get("/openapi.json")).json()["paths"]
        assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/metrics"} <= set(paths)


async def test_index_names_the_server_and_links_onwards(tokenizer):
    async with served(tokenizer) as (http, _s, _f):
        r = await http.get("/")
        assert r.status_code == 200
        body = r.json()
        assert body["name"] == "pkgd" and body["version"] and body["models"] == ["SmolLM2-135M-Instruct"]
        for link in body["links"].values():
            assert (await http.get(link)).status_code == 200, link
    keys = VllmConfig.model_validate({"frontend": {"api_keys": ["k1"]}})
    async with served(tokenizer, config=keys) as (http, _s, _f):
        body = (await http.get("/")).json()  # open, but says no more than /health does
        assert "models" not in body and "Bearer" in body["authentication"]


async def test_metrics_use_vllm_names_and_count_requests(tokenizer):
    async with served(tokenizer) as (http, _s, _f):
        await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4})
        text = (await http.get("/metrics")).text
        for name in (
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:time_to_first_token_seconds_bucket",
            "vllm:inter_token_latency_seconds_bucket",
            "vllm:e2e_request_latency_seconds_count",
            "vllm:request_success_total",
        ):
            assert name in text, name
        assert 'vllm:generation_tokens_total{engine="0",model_name="SmolLM2-135M-Instruct"} 4.0' in text
        assert (
            'vllm:request_success_total{engine="0",finished_reason="length",model_name="SmolLM2-135M-Instruct"} 1.0'
            in text
        )
        assert 'vllm:kv_cache_usage_perc{engine="0",model_name="SmolLM2-135M-Instruct"} 0.25' in text


async def test_api_keys_are_required_and_reload_live(tokenizer):
    cfg = VllmConfig.model_validate({"frontend": {"api_keys": ["k1", "k2"]}})
    async with served(tokenizer, config=cfg) as (http, state, _f):
        body = {"prompt": "x", "max_tokens": 1}
        assert (await http.post("/v1/completions", json=body)).status_code == 401
        r = await http.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (
            await http.post("/v1/completions", json=body, headers={"Authorization": "Bearer k2"})
        ).status_code == 200
        assert (await http.get("/v1/models", headers={"Authorization": "Basic k1"})).status_code == 401
        assert (await http.get("/health")).status_code == 200  # admin routes stay open
        assert (await http.get("/metrics")).status_code == 200
        state.config = VllmConfig.model_validate({"frontend": {"api_keys": ["k3"]}})
        assert (await http.get("/v1/models", headers={"Authorization": "Bearer k1"})).status_code == 401
        assert (await http.get("/v1/models", headers={"Authorization": "Bearer k3"})).status_code == 200


async def test_cors_follows_the_config(tokenizer):
    pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    async with served(tokenizer) as (http, state, _f):
        r = await http.options("/v1/completions", headers=pre)
        assert "access-control-allow-origin" not in r.headers
        state.config = VllmConfig.model_validate({"frontend": {"cors": {"allowed_origins": ["https://app.example"]}}})
        r = await http.options("/v1/completions", headers=pre)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = await http.get("/v1/models", headers={"Origin": "https://app.example"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"


def test_api_modules_never_import_torch():
    import importlib.util

    frontend = (
        "import pkgd.frontend.async_llm as a; a._import_frontend();"
        if importlib.util.find_spec("pkgd.frontend.input_processor")
        else ""
    )
    code = (
        "import sys; import pkgd.api.server, pkgd.api.app, pkgd.frontend.async_llm, pkgd.ipc.client;"
        "import pkgd.parsers.hermes, pkgd.parsers.reasoning;"
        + frontend
        + "bad = [m for m in ('torch', 'hydra') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

"""LoRA served end to end: an engine-core process and an API-server process started as the
supervisor starts them, a tiny Qwen2 GGUF (float32 tensors, so the weights are transformers'
own) with two adapters from ``lora.lora_modules``, driven by the ``openai`` client. Base and
both adapters are asked concurrently (one engine step batches them) and each answer equals
transformers + peft greedy; a third adapter loads at run time, is listed, serves and unloads;
bad adapters and names get their errors and the daemon keeps serving."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest
from tests.runner.lora_adapters import greedy, make_adapter
from tests.runner.tiny_gguf import write_gguf
from tests.runner.tiny_models import build_tiny

from pkgd.config.vllm_config import VllmConfig

from .test_serving_e2e import Daemon

pytestmark = pytest.mark.slow
PROMPT = list(range(3, 17))
N = 5


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-serve")
    hf = build_tiny("qwen2", tmp / "hf")
    path = write_gguf(hf, tmp / "tiny-qwen2.F32.gguf")
    refs = {
        "base": hf,
        "sql": make_adapter(hf, tmp / "sql", r=8, seed=1),
        "chat": make_adapter(hf, tmp / "chat", r=4, targets=["q_proj", "v_proj", "gate_proj"], seed=2),
        "late": make_adapter(hf, tmp / "late", r=8, targets=["o_proj", "down_proj"], seed=3, rslora=True),
    }
    make_adapter(hf, tmp / "big", r=16, seed=4)
    make_adapter(build_tiny("llama", tmp / "other", hidden_size=32), tmp / "other-arch", r=4, seed=5)
    config = VllmConfig.model_validate({
        "model": {"source": str(path), "max_model_len": 128, "cache_dir": str(tmp / "cache"), "name": "base"},
        "frontend": {"allow_runtime_lora_updating": True, "api_keys": ["k"]},
        "lora": {
            "enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
            "lora_modules": [{"name": "sql", "path": str(tmp / "sql")}, f"chat={tmp / 'chat'}"],
        },
    })  # fmt: skip
    daemon = Daemon(tmp / "serve", config=config)
    yield daemon, refs, tmp
    daemon.stop()


def _client(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="k", max_retries=0)


def _complete(client, model: str) -> list[int]:
    r = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text


def _post(daemon, path: str, body: dict, key: str | None = "k") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{daemon.url}{path}", json=body, headers=headers, timeout=60)


def _want_text(tmp, model) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(next((tmp / "cache").rglob("tokenizer.json")).parent)
    return tok.decode(greedy(model, PROMPT, N))


def test_base_and_two_adapters_concurrently_match_peft(served):
    daemon, refs, tmp = served
    client = _client(daemon)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"base", "sql", "chat"}
    assert models["sql"].model_extra["parent"] == "base" and models["sql"].model_extra["root"] == str(tmp / "sql")
    names = ["base", "sql", "chat"] * 3
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        texts = list(pool.map(lambda m: _complete(client, m), names))
    want = {m: _want_text(tmp, refs[m]) for m in ("base", "sql", "chat")}
    assert len(set(want.values())) == 3  # the adapters change the answer
    assert texts == [want[m] for m in names]


def test_runtime_load_serve_unload(served):
    daemon, refs, tmp = served
    client = _client(daemon)
    assert (
        _post(
            daemon, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(tmp / "late")}, key=None
        ).status_code
        == 401
    )
    r = _post(daemon, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(tmp / "late")})
    assert r.status_code == 200, r.text
    assert "late" in {m.id for m in client.models.list().data}
    assert _complete(client, "late") == _want_text(tmp, refs["late"])
    r = _post(daemon, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(tmp / "late")})
    assert r.status_code == 400 and "already been loaded" in r.text
    assert _post(daemon, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    assert "late" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError) as err:
        _complete(client, "late")
    assert err.value.status_code == 404 and "does not exist" in err.value.message
    r = _post(daemon, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert r.status_code == 404 and "cannot be found" in json.dumps(r.json())


@pytest.mark.parametrize(
    "adapter, problem",
    [
        ("big", "rank 16 is greater than lora.max_lora_rank 8"),
        ("missing", "is not a directory"),
        ("other-arch", "an adapter for another model"),
    ],
)
def test_bad_adapters_are_400_naming_the_problem_and_nothing_loads(served, adapter, problem):
    daemon, refs, tmp = served
    r = _post(daemon, "/v1/load_lora_adapter", {"lora_name": adapter, "lora_path": str(tmp / adapter)})
    assert r.status_code == 400, r.text
    assert problem in r.json()["error"]["message"]
    client = _client(daemon)
    assert adapter not in {m.id for m in client.models.list().data}
    assert _complete(client, "sql") == _want_text(tmp, refs["sql"])  # still serving


def test_unknown_target_module_is_named(served, tmp_path):
    daemon, refs, _ = served
    make_adapter(refs["base"], tmp_path / "emb", r=4, targets=["q_proj", "embed_tokens"], seed=6)
    r = _post(daemon, "/v1/load_lora_adapter", {"lora_name": "emb", "lora_path": str(tmp_path / "emb")})
    assert r.status_code == 400 and "target module 'embed_tokens'" in r.json()["error"]["message"]


def test_unknown_model_is_openai_404(served):
    daemon, _, _ = served
    with pytest.raises(openai.NotFoundError) as err:
        _client(daemon).completions.create(model="nope", prompt=PROMPT, max_tokens=1)
    assert err.value.body["code"] == "model_not_found"


def test_lora_requests_info_metric(served):
    daemon, _, _ = served
    text = httpx.get(f"{daemon.url}/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line


def test_runtime_routes_are_404_when_updating_is_off(tmp_path):
    """vLLM registers the routes only with VLLM_ALLOW_RUNTIME_LORA_UPDATING."""
    from fastapi.testclient import TestClient

    from pkgd.api.app import build_app
    from pkgd.api.state import ServerState

    state = ServerState(VllmConfig.model_validate({"lora": {"enable_lora": True}}), llm=None, metrics=None)  # type: ignore[arg-type]
    client = TestClient(build_app(state))
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert r.status_code == 404

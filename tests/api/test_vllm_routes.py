"""/v1/embeddings, /v1/models/{id}, SageMaker's /ping and /invocations, /tokenizer_info and
the development routes, on the app with the in-process fake engine (the behaviour under test
is the app's; the real engine's side is in test_vllm_routes_e2e.py)."""

from __future__ import annotations

import base64
import struct

import pytest

from pkgd.config.vllm_config import VllmConfig
from pkgd.ipc.messages import UtilityResult

from .conftest import served
from .fakes import HIDDEN, fake_vector

pytestmark = pytest.mark.anyio
MESSAGES = [{"role": "user", "content": "Hi"}]
JSON = {"content-type": "application/json"}


def _cfg(**frontend) -> VllmConfig:
    return VllmConfig.model_validate({"frontend": frontend})


def _floats(b64: str) -> list[float]:
    raw = base64.b64decode(b64)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


async def test_embeddings_of_strings_and_token_ids_in_input_order(tokenizer):
    async with served(tokenizer, runner="pooling") as (http, _s, fake):
        texts = ["a", "hello world, again", "b c"]
        r = await http.post("/v1/embeddings", json={"input": texts})
        body = r.json()
        assert r.status_code == 200 and body["object"] == "list" and body["model"] == "SmolLM2-135M-Instruct"
        lens = [len(tokenizer.encode(t)) for t in texts]
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert [d["embedding"] for d in body["data"]] == [fake_vector([0] * n) for n in lens]
        assert body["usage"] == {"prompt_tokens": sum(lens), "total_tokens": sum(lens), "completion_tokens": 0}
        assert all(req.pooling_params is not None and req.sampling_params is None for req in fake.added)
        b64 = (await http.post("/v1/embeddings", json={"input": [[5, 6], [7]], "encoding_format": "base64"})).json()
        assert [_floats(d["embedding"]) for d in b64["data"]] == [fake_vector([0, 0]), fake_vector([0])]
        one = (await http.post("/v1/embeddings", json={"input": [9, 9, 9], "dimensions": 3})).json()
        assert one["data"][0]["embedding"] == fake_vector([0] * 3, 3) and fake.added[-1].pooling_params.dimensions == 3


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"input": []}, "must not be empty"),
        ({"input": ["a", ""]}, "empty string"),
        ({"input": [[1, 2], [49152]]}, "out of range"),
        ({"input": "x", "dimensions": HIDDEN + 1}, "at most the model's hidden size"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": [1] * 2049}, "more than max_model_len 2048"),
    ],
)
async def test_bad_embedding_requests_are_400s(tokenizer, body, fragment):
    async with served(tokenizer, runner="pooling") as (http, _s, fake):
        r = await http.post("/v1/embeddings", json=body)
        assert r.status_code == 400 and fragment in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "invalid_request_error" and not fake.added


async def test_truncate_prompt_tokens_keeps_the_last_tokens(tokenizer):
    async with served(tokenizer, runner="pooling") as (http, _s, fake):
        r = await http.post("/v1/embeddings", json={"input": list(range(10, 20)), "truncate_prompt_tokens": 4})
        assert r.status_code == 200 and fake.added[-1].prompt_token_ids == [16, 17, 18, 19]


async def test_the_runner_decides_which_apis_answer(tokenizer):
    async with served(tokenizer) as (http, _s, _f):
        r = await http.post("/v1/embeddings", json={"input": "x"})
        assert r.status_code == 400 and "does not support the Embeddings API" in r.json()["error"]["message"]
    async with served(tokenizer, runner="pooling") as (http, _s, _f):
        for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "x"})):
            r = await http.post(path, json=body)
            assert r.status_code == 400 and "pooling model" in r.json()["error"]["message"], path


async def test_retrieve_a_model_and_unknown_is_an_openai_404(tokenizer):
    async with served(tokenizer, config=_cfg(served_model_names=["smol", "org/gpt-4o"])) as (http, _s, _f):
        card = (await http.get("/v1/models/org/gpt-4o")).json()
        assert card["id"] == "org/gpt-4o" and card["object"] == "model" and card["max_model_len"] == 2048
        r = await http.get("/v1/models/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_ping_and_invocations_dispatch_by_body_shape(tokenizer):
    async with served(tokenizer, config=_cfg(api_keys=["sk-1"])) as (http, _s, _f):
        assert (await http.get("/ping")).json() == {"status": "ok"}  # open, like /health
        assert (await http.post("/ping")).status_code == 200
        assert (await http.post("/invocations", json={"prompt": "x"})).status_code == 401
        auth = {"Authorization": "Bearer sk-1"}
        chat = (await http.post("/invocations", json={"messages": MESSAGES, "max_tokens": 3}, headers=auth)).json()
        assert chat["object"] == "chat.completion"
        text = (await http.post("/invocations", json={"prompt": "x", "max_tokens": 3}, headers=auth)).json()
        assert text["object"] == "text_completion"
        r = await http.post("/invocations", json={"input": "x"}, headers=auth)
        assert r.status_code == 400 and "ChatCompletionRequest, CompletionRequest" in r.json()["error"]["message"]
        assert (await http.post("/invocations", content=b"{", headers={**auth, **JSON})).status_code == 400
        assert (await http.post("/invocations", content=b"{}", headers=auth)).status_code == 415
    async with served(tokenizer, runner="pooling") as (http, _s, _f):
        emb = (await http.post("/invocations", json={"input": "x"})).json()
        assert emb["object"] == "list" and emb["data"][0]["object"] == "embedding"


async def test_tokenizer_info_is_gated_and_carries_what_lm_eval_reads(tokenizer):
    async with served(tokenizer) as (http, state, _f):
        assert (await http.get("/tokenizer_info")).status_code == 404
        state.config = _cfg(enable_tokenizer_info_endpoint=True)  # a live field
        info = (await http.get("/tokenizer_info")).json()
        assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
        assert info["chat_template"] == tokenizer.chat_template and info["tokenizer_class"] == type(tokenizer).__name__
        assert not any(k.endswith("_file") or k == "name_or_path" for k in info)


async def test_dev_routes_need_dev_mode_and_call_every_engine(tokenizer):
    async with served(tokenizer) as (http, state, fake):
        for method, path in (
            ("GET", "/server_info"),
            ("POST", "/reset_prefix_cache"),
            ("POST", "/sleep"),
            ("POST", "/wake_up"),
            ("GET", "/is_sleeping"),
        ):
            assert (await http.request(method, path)).status_code == 404, path
        state.config = _cfg(server_dev_mode=True, api_keys=["sk-1"])
        assert (await http.get("/server_info")).status_code == 401
        auth = {"Authorization": "Bearer sk-1"}
        info = (await http.get("/server_info", headers=auth)).json()
        assert (
            info["vllm_config"]["frontend"]["api_keys"] == ["**********"]
            and info["engines"][0]["max_model_len"] == 2048
        )
        fake.utility_answers["reset_prefix_cache"] = UtilityResult(call_id=0, engine_index=0, result=True)
        assert (await http.post("/reset_prefix_cache", headers=auth)).json() == {"reset": True}
        fake.utility_answers["reset_prefix_cache"] = UtilityResult(call_id=0, engine_index=0, result=False)
        assert (await http.post("/reset_prefix_cache", headers=auth)).status_code == 409
        fake.utility_answers["sleep"] = UtilityResult(
            call_id=0, engine_index=0, error="sleep mode is off", error_status=400
        )
        r = await http.post("/sleep?level=2", headers=auth)
        assert r.status_code == 400 and r.json()["error"]["message"] == "sleep mode is off"
        await http.post("/wake_up?tags=weights", headers=auth)
        assert ("sleep", {"level": 2}) in fake.utility_calls and (
            "wake_up",
            {"tags": ["weights"]},
        ) in fake.utility_calls
        fake.utility_answers["is_sleeping"] = UtilityResult(call_id=0, engine_index=0, result=True)
        assert (await http.get("/is_sleeping", headers=auth)).json() == {"is_sleeping": True}


async def test_the_model_source_as_given_is_a_name_as_vllm_serves_it(tokenizer):
    """vLLM serves ``--model PATH`` as ``PATH``; pkgd lists the file's stem, and accepts the path
    as given (answered under it) while no name is set, and only then."""
    source = VllmConfig().model.source
    async with served(tokenizer) as (http, _s, _f):
        listed = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
        assert source not in listed
        r = await http.post("/v1/completions", json={"model": source, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == source
        r = await http.post("/v1/completions", json={"model": source + "x", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 404
    async with served(tokenizer, config=_cfg(served_model_names=["smol"])) as (http, _s, _f):
        r = await http.post("/v1/completions", json={"model": source, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

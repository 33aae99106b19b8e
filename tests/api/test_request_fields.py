"""Every field of vLLM's chat and completion requests honoured, ignored (and logged) or refused
with a 400 naming it (`pkgd.api.request_fields`, the one source of docs/request-fields.md),
through the app with the scripted engine: what reaches the engine, the request id and its
``X-Request-Id`` header, the chat template's kwargs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
import structlog

from pkgd.api import protocol, request_fields, serving
from pkgd.api.serving_chat import template_args

from .conftest import served

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
BASE = {
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
    "completion": ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3}),
}
MODELS = {"chat": protocol.ChatCompletionRequest, "completion": protocol.CompletionRequest}


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_every_field_of_the_request_models_has_a_row(endpoint):
    rows = request_fields.rows_for(endpoint)
    declared = set(MODELS[endpoint].model_fields)
    assert not sorted(declared - set(rows)), "a request field without a row in pkgd.api.request_fields"
    # honoured and ignored fields are declared (a refused one is refused by the unknown-field
    # check or, declared, by a validator: test_refused_fields_are_a_400_naming_them)
    assert not [n for n, r in rows.items() if r.status != "refused" and n not in declared]


def test_the_docs_table_is_current():
    assert (ROOT / "docs" / "request-fields.md").read_text() == request_fields.markdown(), (
        "regenerate: python -m pkgd.api.request_fields > docs/request-fields.md"
    )


def test_a_field_without_a_row_fails_the_check():
    class Probe(protocol.ChatCompletionRequest):
        surely_not_a_vllm_field: int = 0

    assert "surely_not_a_vllm_field" not in request_fields.rows_for("chat")
    assert "surely_not_a_vllm_field" in Probe.model_fields


async def test_refused_fields_are_a_400_naming_them(tokenizer):
    async with served(tokenizer) as (http, _s, fake):
        for endpoint, (path, base) in BASE.items():
            for row in request_fields.rows_for(endpoint).values():
                if row.status != "refused":
                    continue
                r = await http.post(path, json={**base, row.name: row.example})
                assert r.status_code == 400, (endpoint, row.name, r.text)
                assert row.name in r.json()["error"]["message"], (endpoint, row.name)
        assert not fake.added


async def test_ignored_fields_are_accepted_and_logged_once(tokenizer):
    serving._IGNORED_LOGGED.clear()
    async with served(tokenizer) as (http, _s, fake):
        with structlog.testing.capture_logs() as logs:
            for _ in range(2):
                for endpoint, (path, base) in BASE.items():
                    extra = {
                        r.name: r.example for r in request_fields.rows_for(endpoint).values() if r.status == "ignored"
                    }
                    r = await http.post(path, json={**base, **extra})
                    assert r.status_code == 200, r.text
        ignored = sorted(e["field"] for e in logs if e["event"] == "request_field_ignored")
        assert ignored == sorted(r.name for r in request_fields.ROWS if r.status == "ignored")
        r = await http.post(BASE["chat"][0], json={**BASE["chat"][1], "modalities": ["text", "audio"]})
        assert r.status_code == 400 and "modalities" in r.json()["error"]["message"]


async def test_sampling_fields_reach_the_engine(tokenizer):
    async with served(tokenizer) as (http, _s, fake):
        c = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)
        await c.completions.create(
            model=MODEL,
            prompt="one two three four five six",
            max_tokens=3,
            extra_body={
                "allowed_token_ids": [5, 6, 7],
                "bad_words": ["Paris", "big city"],
                "truncate_prompt_tokens": 2,
            },
        )
        req = fake.added[-1]
        sp = req.sampling_params
        assert sp.allowed_token_ids == [5, 6, 7] and sp.bad_words == ["Paris", "big city"]
        paris = tokenizer.encode("Paris", add_special_tokens=False)
        assert paris in sp.bad_words_token_ids and tokenizer.encode(" Paris", add_special_tokens=False) in (
            sp.bad_words_token_ids
        )
        assert req.prompt_token_ids == tokenizer.encode("one two three four five six")[-2:]
        await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], extra_body={"truncate_prompt_tokens": 3}
        )
        assert len(fake.added[-1].prompt_token_ids) == 3
        for body, field in (
            ({"allowed_token_ids": [VOCAB_OUT]}, "allowed_token_ids"),
            ({"allowed_token_ids": []}, "allowed_token_ids"),
            ({"truncate_prompt_tokens": 5000}, "truncate_prompt_tokens"),
            ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
            ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ):
            r = await http.post(BASE["completion"][0], json={**BASE["completion"][1], **body})
            assert r.status_code == 400 and field in r.json()["error"]["message"], (body, r.text)


VOCAB_OUT = 49152  # the fake engine's vocabulary size: one past the last id


async def test_request_id_names_the_response_and_the_header_echoes(tokenizer):
    async with served(tokenizer) as (http, _s, fake):
        r = await http.post(BASE["completion"][0], json={**BASE["completion"][1], "request_id": "job-7"})
        assert r.json()["id"] == "cmpl-job-7" and r.headers["x-request-id"] == "cmpl-job-7"
        assert fake.added[-1].request_id == "cmpl-job-7"
        r = await http.post(
            BASE["chat"][0], json={**BASE["chat"][1], "request_id": "job-8"}, headers={"X-Request-Id": "trace-1"}
        )
        assert r.json()["id"] == "chatcmpl-job-8" and r.headers["x-request-id"] == "trace-1"
        r = await http.post(BASE["chat"][0], json=BASE["chat"][1], headers={"X-Request-Id": "trace-2"})
        assert r.json()["id"].startswith("chatcmpl-trace-2-") and r.headers["x-request-id"] == "trace-2"
        r = await http.post(BASE["chat"][0], json=BASE["chat"][1])
        assert r.headers["x-request-id"] == r.json()["id"]
        async with http.stream(
            "POST", BASE["chat"][0], json={**BASE["chat"][1], "stream": True, "request_id": "s-1"}
        ) as s:
            assert s.headers["x-request-id"] == "chatcmpl-s-1"
            assert '"id":"chatcmpl-s-1"' in (await s.aread()).decode()
        bad = await http.post(BASE["chat"][0], json={**BASE["chat"][1], "request_id": "a b\n"})
        assert bad.status_code == 400 and "request_id" in bad.text
        fake.gate = asyncio.Event()
        first = asyncio.ensure_future(http.post(BASE["chat"][0], json={**BASE["chat"][1], "request_id": "busy"}))
        while not any(a.request_id == "chatcmpl-busy" for a in fake.added):
            await asyncio.sleep(0.01)
        again = await http.post(BASE["chat"][0], json={**BASE["chat"][1], "request_id": "busy"})
        assert again.status_code == 400 and "request_id" in again.json()["error"]["message"]
        fake.gate.set()
        assert (await first).status_code == 200


def test_reasoning_effort_and_documents_reach_the_chat_template():
    body = protocol.ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "reasoning_effort": "low",
            "documents": [{"title": "t", "text": "x"}],
        }
    )
    args = template_args(body)
    assert args["chat_template_kwargs"] == {"reasoning_effort": "low"} and args["documents"] == [
        {"title": "t", "text": "x"}
    ]
    body.chat_template_kwargs = {"reasoning_effort": "high", "enable_thinking": False}
    assert template_args(body)["chat_template_kwargs"] == {"reasoning_effort": "high", "enable_thinking": False}


async def test_reasoning_effort_is_rendered_by_a_template_that_reads_it(tokenizer, monkeypatch):
    template = "{{ reasoning_effort | default('unset') }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    monkeypatch.setattr(tokenizer, "chat_template", template)
    async with served(tokenizer) as (http, _s, fake):
        r = await http.post(BASE["chat"][0], json={**BASE["chat"][1], "reasoning_effort": "medium"})
        assert r.status_code == 200, r.text
        assert tokenizer.decode(fake.added[-1].prompt_token_ids) == "medium|Hi"

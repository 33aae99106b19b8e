"""The OpenAI routes through the official ``openai`` client, with the engine replaced by the
scripted `FakeEngineClient` (what is checked is the app's: formats, usage, streaming,
n, echo, logprobs, stop strings, aborts)."""

from __future__ import annotations

import json

import openai
import pytest

from .conftest import ANSWER, answer_script, served

pytestmark = pytest.mark.anyio
MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def client(http) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)


async def test_chat_completion_has_the_answer_and_honest_usage(tokenizer):
    async with served(tokenizer) as (http, state, fake):
        r = await client(http).chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
        assert r.choices[0].message.content == ANSWER and r.choices[0].finish_reason == "stop"
        prompt = state.llm.input_processor.render_chat(MESSAGES)
        assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
        assert r.usage.completion_tokens == len(tokenizer.encode(ANSWER, add_special_tokens=False)) + 1  # + EOS
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert fake.added[0].sampling_params.temperature == 0


async def test_streaming_chat_equals_non_streaming_and_reports_usage(tokenizer):
    async with served(tokenizer) as (http, _state, _fake):
        c = client(http)
        full = await c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
        stream = await c.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        text, usage, roles, finish = "", None, [], None
        async for chunk in stream:
            if not chunk.choices:
                usage = chunk.usage
                continue
            delta = chunk.choices[0].delta
            roles += [delta.role] if delta.role else []
            text += delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        assert text == full.choices[0].message.content and roles == ["assistant"] and finish == "stop"
        assert usage.model_dump() == full.usage.model_dump()


async def test_sse_framing_ends_with_done(tokenizer):
    async with served(tokenizer) as (http, _s, _f):
        r = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True})
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.text.split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(
            tokenizer.encode(ANSWER, add_special_tokens=False)[:3]
        )


async def test_completion_stream_equals_non_stream_with_max_tokens(tokenizer):
    async with served(tokenizer) as (http, _s, _f):
        c = client(http)
        full = await c.completions.create(model=MODEL, prompt="Hello", max_tokens=5)
        text = ""
        async for chunk in await c.completions.create(model=MODEL, prompt="Hello", max_tokens=5, stream=True):
            text += chunk.choices[0].text
        assert text == full.choices[0].text and full.choices[0].finish_reason == "length"
        assert full.usage.completion_tokens == 5


async def test_n_and_batched_prompts_number_the_choices(tokenizer):
    async with served(tokenizer) as (http, _s, fake):
        c = client(http)
        r = await c.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=2, seed=7)
        assert sorted(ch.index for ch in r.choices) == [0, 1, 2, 3]
        assert r.usage.completion_tokens == 8
        assert sorted(req.sampling_params.seed for req in fake.added) == [7, 7, 8, 8]  # child i gets seed + i
        chat = await c.chat.completions.create(model=MODEL, messages=MESSAGES, n=3)
        assert [ch.index for ch in chat.choices] == [0, 1, 2]
        streamed = {}
        async for chunk in await c.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, stream=True):
            for ch in chunk.choices:
                streamed[ch.index] = streamed.get(ch.index, "") + (ch.delta.content or "")
        assert streamed == {0: ANSWER, 1: ANSWER}


async def test_token_id_prompts_and_echo(tokenizer):
    ids = tokenizer.encode("The capital", add_special_tokens=False)
    async with served(tokenizer) as (http, _s, fake):
        c = client(http)
        r = await c.completions.create(model=MODEL, prompt=ids, max_tokens=2, echo=True)
        assert fake.added[0].prompt_token_ids == ids
        assert r.choices[0].text.startswith("The capital") and r.usage.prompt_tokens == len(ids)
        r2 = await c.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=1)
        assert len(r2.choices) == 2


async def test_completion_logprobs_with_echo_cover_prompt_and_output(tokenizer):
    async with served(tokenizer) as (http, _s, _f):
        r = await client(http).completions.create(
            model=MODEL, prompt="The capital of", max_tokens=3, logprobs=2, echo=True
        )
        lp = r.choices[0].logprobs
        n_prompt = r.usage.prompt_tokens
        assert len(lp.tokens) == n_prompt + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[n_prompt:] == [-0.1] * 3
        assert all(len(t) == 3 for t in lp.top_logprobs[n_prompt:])  # sampled + 2 alternatives
        assert "".join(lp.tokens) == r.choices[0].text
        assert lp.text_offset == sorted(lp.text_offset)


async def test_chat_logprobs_and_top_logprobs(tokenizer):
    async with served(tokenizer) as (http, _s, _f):
        r = await client(http).chat.completions.create(
            model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=3, max_tokens=4
        )
        content = r.choices[0].logprobs.content
        assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
        assert "".join(c.token for c in content) == r.choices[0].message.content
        assert content[0].bytes == list(content[0].token.encode())


async def test_stop_string_cuts_the_text_and_aborts_the_engine_request(tokenizer):
    long = ANSWER + " It is a large city with many museums and parks to see."
    async with served(tokenizer, script=answer_script(tokenizer, long)) as (http, _s, fake):
        r = await client(http).completions.create(model=MODEL, prompt="Q:", max_tokens=40, stop=["Paris"])
        assert r.choices[0].text == "The capital of France is " and r.choices[0].finish_reason == "stop"
        assert r.choices[0].model_extra.get("stop_reason") == "Paris"
        assert fake.aborted == [fake.added[0].request_id]


async def test_max_completion_tokens_wins_over_max_tokens(tokenizer):
    async with served(tokenizer) as (http, _s, fake):
        r = await client(http).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=9, max_completion_tokens=2
        )
        assert r.usage.completion_tokens == 2 and fake.added[0].sampling_params.max_tokens == 2


async def test_generation_defaults_from_the_config_fill_unset_fields(tokenizer):
    from pkgd.config.vllm_config import VllmConfig

    cfg = VllmConfig.model_validate({"model": {"generation": {"temperature": 0.3, "max_tokens": 3}}})
    async with served(tokenizer, config=cfg) as (http, _s, fake):
        r = await client(http).chat.completions.create(model=MODEL, messages=MESSAGES)
        sp = fake.added[0].sampling_params
        assert sp.temperature == 0.3 and sp.max_tokens == 3 and r.usage.completion_tokens == 3


async def test_engine_failure_mid_stream_ends_with_an_error_event(tokenizer):
    from pkgd.ipc.client import EngineRequestError

    async with served(tokenizer) as (http, state, fake):
        original = fake.add_requests

        def failing(reqs):
            for r in reqs:
                fake.fail[r.request_id] = EngineRequestError(
                    "engine core at ipc://x disconnected (crashed or restarting)"
                )
            return original(reqs)

        fake.add_requests = failing
        r = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True})
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2][6:])
        assert "disconnected" in err["error"]["message"] and err["error"]["type"] == "service_unavailable"
        r = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert r.status_code == 503 and "disconnected" in r.json()["error"]["message"]
        assert state.llm.num_inflight() == 0


async def test_request_timeout_aborts_with_503(tokenizer):
    from pkgd.config.vllm_config import VllmConfig

    cfg = VllmConfig.model_validate({"frontend": {"request_timeout": 0.2}})
    async with served(tokenizer, config=cfg) as (http, state, fake):
        fake.delay = 0.1  # 9 tokens take ~0.9 s
        r = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert r.status_code == 503 and "request_timeout" in r.json()["error"]["message"]
        assert fake.aborted == [fake.added[0].request_id] and state.llm.num_inflight() == 0


async def test_log_requests_logs_one_line_per_request(tokenizer):
    import io

    from pkgd import log
    from pkgd.config.vllm_config import VllmConfig

    cfg = VllmConfig.model_validate({"logging": {"log_requests": True, "format": "json"}})
    buf = io.StringIO()
    log.configure(cfg.logging, role="api-server", stream=buf)
    try:
        async with served(tokenizer, config=cfg) as (http, _s, _f):
            r = await http.post(
                "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, headers={"x-request-id": "abc"}
            )
    finally:
        log.configure(role="test")
    lines = [json.loads(line) for line in buf.getvalue().splitlines() if "request_finished" in line]
    assert len(lines) == 1 and lines[0]["request_id"] == r.json()["id"] and r.json()["id"].startswith("cmpl-abc-")
    assert (
        lines[0]["completion_tokens"] == 3
        and lines[0]["finish_reason"] == "length"
        and lines[0]["role"] == "api-server"
    )


async def test_chat_echo_continues_the_final_assistant_message(tokenizer):
    async with served(tokenizer) as (http, _s, _f):
        body = {
            "messages": [*MESSAGES, {"role": "assistant", "content": "Well,"}],
            "echo": True,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "max_tokens": 3,
        }
        r = (await http.post("/v1/chat/completions", json=body)).json()
        assert r["choices"][0]["message"]["content"].startswith("Well,The")


async def test_stop_may_be_a_single_string_and_stop_token_ids_end_a_request(tokenizer):
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    async with served(tokenizer) as (http, _s, fake):
        r = (await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "stop": " France"})).json()
        assert r["choices"][0]["text"] == "The capital of" and r["choices"][0]["finish_reason"] == "stop"
        r = (
            await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "stop_token_ids": [ids[2]]})
        ).json()
        assert r["choices"][0]["finish_reason"] == "stop" and fake.added[-1].sampling_params.stop_token_ids == [ids[2]]

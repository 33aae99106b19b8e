"""Hostile but valid input: ``frontend.limits``, integers beyond int64, lone surrogates,
out-of-vocabulary token ids, errors inside a stream, and CPU work kept off the event loop."""

from __future__ import annotations

import json
import threading

import pytest

from pkgd.config.vllm_config import VllmConfig

from .conftest import count_validations, served
from .fakes import VOCAB

pytestmark = pytest.mark.anyio
MESSAGES = [{"role": "user", "content": "hi"}]
HUGE = 2**70

SMALL = VllmConfig.model_validate(
    {
        "frontend": {
            "limits": {
                "max_messages": 4,
                "max_prompts": 2,
                "max_input_chars": 100,
                "max_n": 3,
                "max_logprobs": 2,
                "max_stop_strings": 2,
                "max_stop_string_chars": 5,
                "max_stop_token_ids": 2,
                "max_logit_bias": 2,
            }
        }
    }
)

LIMIT_CASES = [
    # (path, body, status, limit named)
    ("/v1/chat/completions", {"messages": MESSAGES * 5}, 400, "max_messages"),
    ("/tokenize", {"messages": MESSAGES * 5}, 400, "max_messages"),
    ("/v1/completions", {"prompt": ["a", "b", "c"]}, 400, "max_prompts"),
    ("/v1/completions", {"prompt": "x" * 101}, 413, "max_input_chars"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 101}]}]},
        413,
        "max_input_chars",
    ),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f" * 101}}]},
        413,
        "max_input_chars",
    ),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 4}, 400, "max_n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 3}, 400, "max_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 3}, 400, "max_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 3}, 400, "max_logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c"]}, 400, "max_stop_strings"),
    ("/v1/completions", {"prompt": "x", "stop": "abcdef"}, 400, "max_stop_string_chars"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [1, 2, 3]}, 400, "max_stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 1, "2": 1, "3": 1}}, 400, "max_logit_bias"),
]


@pytest.mark.parametrize(("path", "body", "status", "limit"), LIMIT_CASES, ids=[c[3] + "-" + c[0] for c in LIMIT_CASES])
async def test_a_request_over_a_limit_is_refused_naming_it(tokenizer, path, body, status, limit):
    async with served(tokenizer, config=SMALL) as (http, state, fake):
        r = await http.post(path, json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert f"frontend.limits.{limit}" in err["message"] and err["code"] == limit
        assert fake.added == []


async def test_limits_are_checked_before_validation(tokenizer, monkeypatch):
    """100 000 messages are refused after one JSON decode, before pydantic builds a model per
    message (validating them alone holds the GIL, so the event loop, for about half a second)."""
    from pkgd.api.protocol import ChatCompletionRequest

    validated = count_validations(monkeypatch, ChatCompletionRequest)
    async with served(tokenizer) as (http, _state, _fake):
        r = await http.post("/v1/chat/completions", json={"messages": MESSAGES * 100_000})
        assert r.status_code == 400 and "max_messages" in r.json()["error"]["message"]
        assert validated == []
        assert (
            await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
        ).status_code == 200
        assert validated == [1]


VALID_JSON_CASES = [
    ("/v1/completions", {"prompt": "x", "priority": HUGE}, "priority"),
    ("/v1/completions", {"prompt": "x", "top_k": HUGE}, "top_k"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [HUGE]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(HUGE): 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"-3": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "min_tokens": HUGE, "max_tokens": None}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": HUGE}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": HUGE}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": [HUGE]}, "prompt"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body", "field"), VALID_JSON_CASES, ids=[c[2] for c in VALID_JSON_CASES])
async def test_valid_json_out_of_range_is_400_never_500(tokenizer, path, body, field, stream):
    async with served(tokenizer) as (http, state, fake):
        r = await http.post(path, json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        assert field in r.json()["error"]["message"]
        assert fake.added == []


@pytest.mark.parametrize("text", ['"\\ud800"', '"\\udc00 x"', '"a\\ud83d"'])
async def test_a_lone_surrogate_is_malformed_json(tokenizer, text):
    body = '{"messages": [{"role": "user", "content": %s}], "stream": true}' % text
    async with served(tokenizer) as (http, _state, fake):
        r = await http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
        message = r.json()["error"]["message"]
        assert "surrogate" in message and message.count("malformed") == 1  # the reason, once
        assert fake.added == []


async def test_a_lone_surrogate_just_before_the_end_is_not_called_truncated(tokenizer):
    """msgspec reports a lone high surrogate within its 6-byte look-ahead of the end of the
    body as truncated input; the answer names the surrogate instead."""
    async with served(tokenizer) as (http, _state, fake):
        r = await http.post(
            "/v1/completions", content='{"prompt": "\\ud800"}', headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
        assert fake.added == []


async def test_a_truncated_body_is_still_called_truncated(tokenizer):
    async with served(tokenizer) as (http, _state, fake):
        r = await http.post(
            "/v1/completions", content='{"prompt": "\\ud800', headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and "truncated" in r.json()["error"]["message"]
        assert fake.added == []


async def test_json_nested_too_deeply_is_400_not_a_recursion_error(tokenizer):
    body = '{"a":' * 100000 + "1" + "}" * 100000
    async with served(tokenizer) as (http, _state, fake):
        r = await http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text
        assert fake.added == []
        assert (await http.get("/health")).status_code == 200


async def test_a_top_k_above_the_vocabulary_means_off(tokenizer):
    async with served(tokenizer) as (http, _state, fake):
        r = await http.post("/v1/completions", json={"prompt": "x", "top_k": VOCAB * 10, "max_tokens": 2})
        assert r.status_code == 200 and fake.added[0].sampling_params.top_k == 0


def _events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


async def test_an_exception_inside_a_stream_ends_it_with_an_error_event_and_done(tokenizer, monkeypatch):
    from pkgd.api import serving_chat

    original = serving_chat._ChoiceStream.update
    calls = []

    def failing(self, c):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("bug in a parser")
        return original(self, c)

    monkeypatch.setattr(serving_chat._ChoiceStream, "update", failing)
    async with served(tokenizer) as (http, state, fake):
        r = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True, "max_tokens": 8})
        events = _events(r.text)
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"
        assert "bug in a parser" in err["message"]
        assert state.llm.num_inflight() == 0 and fake.aborted  # the engine request was aborted
        assert (await http.get("/health")).status_code == 200


async def test_a_failure_processing_engine_outputs_fails_those_requests_only(tokenizer):
    """An exception while detokenizing one step ends the requests of that step with an error
    (the stream gets its error event and [DONE]) and the server keeps serving."""
    async with served(tokenizer) as (http, state, _fake):
        original = state.llm.output_processor.process_outputs
        calls = []

        def failing(outputs, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("detokenizer bug")
            return original(outputs, **kw)

        state.llm.output_processor.process_outputs = failing
        r = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True, "max_tokens": 8})
        events = _events(r.text)
        assert events[-1] == "[DONE]" and "detokenizer bug" in json.loads(events[-2])["error"]["message"]
        state.llm.output_processor.process_outputs = original
        assert (await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status_code == 200
        assert state.llm.num_inflight() == 0


async def test_503_says_when_to_retry(tokenizer):
    async with served(tokenizer) as (http, _state, fake):
        fake.available = False
        r = await http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"].isdigit()
        assert (await http.get("/health")).headers["retry-after"].isdigit()


async def test_parsing_templating_and_tokenizing_run_off_the_event_loop(tokenizer, monkeypatch):
    """The request's CPU work runs on the preprocess pool's threads, never the loop's."""
    from pkgd.api import preprocess
    from pkgd.frontend.input_processor import InputProcessor

    seen: dict[str, set[str]] = {"parse": set(), "template": set(), "tokenize": set()}
    for name, owner, attr in (
        ("parse", preprocess, "parse_body"),
        ("template", InputProcessor, "render_chat"),
        ("tokenize", InputProcessor, "tokenize"),
    ):
        original = getattr(owner, attr)

        def record(*a, _name=name, _original=original, **kw):
            seen[_name].add(threading.current_thread().name)
            return _original(*a, **kw)

        monkeypatch.setattr(owner, attr, record)
    from pkgd.api import routes, serving_chat

    monkeypatch.setattr(serving_chat, "parse_body", preprocess.parse_body)
    monkeypatch.setattr(routes, "parse_body", preprocess.parse_body)
    async with served(tokenizer) as (http, _state, _fake):
        loop_thread = threading.current_thread().name
        assert (
            await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
        ).status_code == 200
        assert (await http.post("/tokenize", json={"messages": MESSAGES})).status_code == 200
    for name, threads in seen.items():
        assert threads and loop_thread not in threads and all(t.startswith("pkgd-preprocess") for t in threads), (
            name,
            threads,
        )


async def test_a_body_that_does_not_arrive_in_time_is_408_and_closes(tokenizer):
    import asyncio

    from pkgd.api.app import build_app

    config = VllmConfig.model_validate({"frontend": {"body_timeout": 0.2}})
    async with served(tokenizer, config=config) as (_http, state, fake):
        app = build_app(state)
        sent: list[dict] = []

        async def trickle():  # a first chunk, then nothing more
            if not sent and not getattr(trickle, "started", False):
                trickle.started = True
                return {"type": "http.request", "body": b'{"prompt": ', "more_body": True}
            await asyncio.sleep(3600)

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "headers": [(b"content-type", b"application/json")],
            "query_string": b"",
            "http_version": "1.1",
            "scheme": "http",
            "server": ("t", 80),
            "client": ("c", 1),
        }
        await asyncio.wait_for(app(scope, trickle, send), 5)
        assert sent[0]["status"] == 408 and (b"connection", b"close") in sent[0]["headers"]
        assert "frontend.body_timeout" in json.loads(sent[1]["body"])["error"]["message"]
        assert fake.added == []

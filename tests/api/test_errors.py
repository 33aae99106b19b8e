"""Bad input gets an OpenAI-shaped error with the right status, changes nothing, and the
server keeps serving (``/health`` answers after each)."""

from __future__ import annotations

import pytest

from .conftest import served
from .fakes import MAX_MODEL_LEN

pytestmark = pytest.mark.anyio
MESSAGES = [{"role": "user", "content": "hi"}]


def _nested(levels: int, key: str) -> dict:
    """A schema of ``levels`` objects (key "properties") or arrays (key "items") in one another."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = (
            {"type": "object", "properties": {"a": schema}}
            if key == "properties"
            else {"type": "array", "items": schema}
        )
    return schema


DEEP = "deep, more than 100"

CASES = [
    # (path, body, status, words the message must contain)
    ("/v1/chat/completions", {"model": "gpt-5", "messages": MESSAGES}, 404, ["gpt-5", "SmolLM2-135M-Instruct"]),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, ["nope"]),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -0.5}, 400, ["temperature", "-0.5"]),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 1.5}, 400, ["top_p"]),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 0}, 400, ["n"]),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, ["max_tokens"]),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": -3}, 400, ["max_completion_tokens"]),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, ["logprobs", "20"]),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, ["top_logprobs", "20"]),
    ("/v1/chat/completions", {"messages": []}, 400, ["messages"]),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, ["role"]),
    ("/v1/chat/completions", {"messages": "hello"}, 400, ["messages"]),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, 400, ["temperature"]),
    ("/v1/completions", {"prompt": ""}, 400, ["prompt"]),
    ("/v1/completions", {"prompt": [[]]}, 400, ["prompt"]),
    ("/v1/completions", {"prompt": [99999999]}, 400, ["99999999"]),
    ("/v1/completions", {}, 400, ["prompt"]),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, ["stop"]),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, 400, ["tool_choice", "needs tools"]),
    (
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        ["tool_choice", "'g'"],
    ),
    ("/v1/chat/completions", {"messages": MESSAGES, "frobnicate": 1}, 400, ["frobnicate", "unrecognized"]),
    (
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        ["stream_options", "stream: true"],
    ),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, 400, ["use_beam_search"]),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, ["max_tokens", "echo"]),
    (
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 5, "maximum": 1}},
            },
        },
        400,
        ["response_format", "minimum"],
    ),
    (
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "strnig"}}},
        },
        400,
        ["response_format", "strnig"],
    ),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "yaml"}}, 400, ["response_format"]),
    (  # the schema checks recurse per level: too deep is the request's error, not a RecursionError's 500
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": _nested(100, "properties")},
            },
        },
        400,
        ["response_format", DEEP],
    ),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": _nested(200, "items")}}, 400, [DEEP]),
    (
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(100, "properties")}}],
            "tool_choice": "required",
        },
        400,
        ["tool_choice", DEEP],
    ),
    (
        "/v1/completions",
        {"prompt": "x", "structured_outputs": {"regex": "[a-"}},
        400,
        ["structured_outputs", "regex", "Unclosed"],
    ),
    ("/v1/completions", {"prompt": "x", "guided_grammar": "root ::= nowhere"}, 400, ["guided_grammar", "nowhere"]),
    (
        "/v1/completions",
        {"prompt": "x", "guided_json": {"type": "object", "required": ["a"], "additionalProperties": False}},
        400,
        ["guided_json", "never be satisfied"],
    ),
    ("/v1/completions", {"prompt": "x", "guided_json": {"not": {"type": "string"}}}, 400, ["guided_json", "'not'"]),
    (
        "/v1/completions",
        {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]},
        400,
        ["guided_regex", "guided_choice"],
    ),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "backend": "outlines"}}, 400, ["backend"]),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {}}, 400, ["structured_outputs", "exactly one"]),
    ("/v1/completions", {"prompt": "x", "guided_choice": []}, 400, ["guided_choice"]),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
        400,
        ["enable_auto_tool_choice"],
    ),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, ["exactly one"]),
    ("/detokenize", {"tokens": [10**9]}, 400, ["out of range"]),
]


@pytest.mark.parametrize(("path", "body", "status", "words"), CASES, ids=[f"{c[2]}-{i}" for i, c in enumerate(CASES)])
async def test_bad_input_gets_its_status_and_the_server_keeps_serving(tokenizer, path, body, status, words):
    async with served(tokenizer) as (http, state, fake):
        r = await http.post(path, json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        for w in words:
            assert w in err["message"], err
        assert fake.added == [] and state.llm.num_inflight() == 0
        assert (await http.get("/health")).status_code == 200


async def test_prompt_plus_max_tokens_beyond_max_model_len_names_both_numbers(tokenizer):
    async with served(tokenizer) as (http, _s, fake):
        prompt_len = len(tokenizer.encode("hello there", add_special_tokens=True))
        r = await http.post("/v1/completions", json={"prompt": "hello there", "max_tokens": MAX_MODEL_LEN})
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert str(MAX_MODEL_LEN) in msg and str(prompt_len) in msg and "max_model_len" in msg
        assert fake.added == []


async def test_malformed_json_is_400(tokenizer):
    async with served(tokenizer) as (http, _s, _f):
        r = await http.post(
            "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        assert (await http.get("/health")).status_code == 200


async def test_oversized_body_is_413_by_length_and_by_streamed_size(tokenizer):
    from pkgd.config.vllm_config import VllmConfig

    cfg = VllmConfig.model_validate({"frontend": {"max_request_body_bytes": 2048}})
    async with served(tokenizer, config=cfg) as (http, _s, fake):
        big = {"prompt": "x" * 5000}
        r = await http.post("/v1/completions", json=big)
        assert r.status_code == 413 and "2048" in r.json()["error"]["message"]

        async def chunks():  # no Content-Length: the limit is enforced while reading
            for _ in range(10):
                yield b" " * 500
            yield b'{"prompt": "x"}'

        r = await http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert fake.added == []
        assert (await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})).status_code == 200


async def test_unknown_route_and_wrong_method_are_openai_shaped(tokenizer):
    async with served(tokenizer) as (http, _s, _f):
        r = await http.get("/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        r = await http.get("/v1/completions")
        assert r.status_code == 405 and "error" in r.json()


async def test_no_engine_available_is_503_and_health_says_so(tokenizer):
    async with served(tokenizer) as (http, _s, fake):
        fake.available = False
        r = await http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert (await http.get("/health")).status_code == 503
        fake.available = True
        assert (await http.get("/health")).status_code == 200


async def test_draining_health_is_503_and_stragglers_are_served_with_connection_close(tokenizer):
    async with served(tokenizer) as (http, state, _f):
        assert "connection" not in (await http.get("/health")).headers
        state.draining = True
        r = await http.get("/health")
        assert r.status_code == 503 and r.headers["connection"] == "close"
        r = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert r.status_code == 200 and r.headers["connection"] == "close"


async def test_engine_rejection_is_400(tokenizer):
    from pkgd.ipc.client import EngineRequestError

    async with served(tokenizer) as (http, _s, fake):

        def reject(reqs):
            for r in reqs:
                fake.sink.on_request_error(
                    [r.request_id], EngineRequestError("prompt token id 5 is banned", rejected=True)
                )
            return 0

        fake.add_requests = reject
        r = await http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 400 and "banned" in r.json()["error"]["message"]


async def test_a_request_in_flight_when_draining_starts_is_answered_with_connection_close(tokenizer):
    import asyncio

    async with served(tokenizer) as (http, state, fake):
        fake.gate = asyncio.Event()  # the request stays in flight until released
        pending = asyncio.ensure_future(http.post("/v1/chat/completions", json={"messages": MESSAGES}))
        for _ in range(1000):  # until it reached the engine (templating runs on a thread)
            if fake.added:
                break
            await asyncio.sleep(0.01)
        assert fake.added and not pending.done()
        state.draining = True
        fake.gate.set()
        r = await pending
        assert r.status_code == 200 and r.headers["connection"] == "close"

"""run-batch: OpenAI batch lines → result lines (fake runner, real tokenizer)."""

import json

import pytest
from tests.smollm2 import smollm2_gguf

from pkgd import LLM
from pkgd.cli.run_batch import process_batch

from .fake_runner import fake_factory


@pytest.fixture(scope="module")
def llm():
    return LLM(
        runner_factory=fake_factory(vocab_size=49152),
        tokenizer=str(smollm2_gguf()),
        name="m",
        num_blocks=64,
        max_model_len=256,
    )


def line(cid, url, body):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def test_completions_and_chat_lines_with_errors_in_between(llm):
    lines = [
        line(
            "c1",
            "/v1/completions",
            {"model": "m", "prompt": ["Hello", "Bye"], "max_tokens": 3, "temperature": 0, "logprobs": 1},
        ),
        "{not json",
        line("bad-url", "/v1/embeddings", {"input": "x"}),
        line("too-long", "/v1/completions", {"prompt": [1] * 250, "max_tokens": 10}),
        line(
            "chat",
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 4,
                "n": 2,
                "seed": 3,
                "logprobs": True,
                "top_logprobs": 2,
            },
        ),
        "",
        line("wrong-model", "/v1/completions", {"model": "other", "prompt": "x"}),
    ]
    res = process_batch(llm, lines)
    assert [r["custom_id"] for r in res] == ["c1", None, "bad-url", "too-long", "chat", "wrong-model"]
    c1 = res[0]["response"]
    assert c1["status_code"] == 200 and res[0]["error"] is None
    body = c1["body"]
    assert body["object"] == "text_completion" and len(body["choices"]) == 2
    assert body["usage"]["completion_tokens"] == 6
    assert len(body["choices"][0]["logprobs"]["tokens"]) == 3
    for r, words in (
        (res[1], "malformed JSON"),
        (res[2], "unsupported url"),
        (res[3], "exceeds max_model_len"),
        (res[5], "does not exist"),
    ):
        assert r["response"]["status_code"] == 400 and words in r["error"]["message"]
    chat = res[4]["response"]["body"]
    assert chat["object"] == "chat.completion" and [c["index"] for c in chat["choices"]] == [0, 1]
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert len(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert not llm.engine.has_unfinished_requests()


def test_a_streaming_line_is_a_per_line_error(llm):
    res = process_batch(
        llm,
        [
            line("s", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
            line("ok", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
        ],
    )
    assert res[0]["response"]["status_code"] == 400 and "stream: true is not supported" in res[0]["error"]["message"]
    assert res[1]["response"]["status_code"] == 200


def test_structured_outputs_and_bad_constraints_in_a_batch(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    lines = [
        line(
            "json",
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 12,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            },
        ),
        line("choice", "/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_choice": ["yes", "no"]}),
        line("bad-regex", "/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "[a-"}}),
        line("unknown", "/v1/completions", {"prompt": "x", "frobnicate": True}),
        line(
            "tool",
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 16,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
        ),
    ]
    res = {r["custom_id"]: r for r in process_batch(llm, lines)}
    assert res["bad-regex"]["response"]["status_code"] == 400 and "Unclosed" in res["bad-regex"]["error"]["message"]
    assert "frobnicate" in res["unknown"]["error"]["message"]
    choice = res["choice"]["response"]["body"]["choices"][0]
    assert choice["text"] in ("yes", "no") and choice["finish_reason"] == "stop"
    msg = res["json"]["response"]["body"]["choices"][0]
    if msg["finish_reason"] == "stop":
        assert isinstance(json.loads(msg["message"]["content"])["a"], int)
    tool = res["tool"]["response"]["body"]["choices"][0]
    if tool["finish_reason"] == "stop":
        assert tool["message"]["tool_calls"][0]["function"]["name"] == "f"


def test_request_fields_are_honoured_in_a_batch(llm):
    res = process_batch(
        llm,
        [
            line(
                "c",
                "/v1/completions",
                {
                    "prompt": "one two three four five",
                    "max_tokens": 2,
                    "truncate_prompt_tokens": 2,
                    "request_id": "r-1",
                },
            ),
            line("p", "/v1/completions", {"prompt": "one two three", "max_tokens": 1, "prompt_logprobs": 1}),
            line(
                "chat",
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "truncate_prompt_tokens": 3},
            ),
            line("bad", "/v1/completions", {"prompt": "x", "max_tokens": 1, "truncate_prompt_tokens": 300}),
        ],
    )
    c, p, chat, bad = (r["response"] for r in res)
    assert c["body"]["id"] == "cmpl-r-1" and c["body"]["usage"]["prompt_tokens"] == 2
    lps = p["body"]["choices"][0]["prompt_logprobs"]
    assert lps[0] is None and len(lps) == p["body"]["usage"]["prompt_tokens"]  # the fake runner computes none
    assert chat["body"]["usage"]["prompt_tokens"] == 3
    assert bad["status_code"] == 400 and "truncate_prompt_tokens" in res[3]["error"]["message"]

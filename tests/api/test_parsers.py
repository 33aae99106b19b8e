"""Tool-call (hermes) and reasoning (``<think>``) parsers: whole text, streamed in every
possible split, and applied by the chat route when configured."""

from __future__ import annotations

import json

import pytest

from pkgd.config.vllm_config import VllmConfig
from pkgd.parsers import load_parser, registered_names
from pkgd.parsers.hermes import HermesToolParser
from pkgd.parsers.reasoning import ThinkTagReasoningParser

from .conftest import answer_script, served

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_registry_loads_the_parsers():
    assert "hermes" in registered_names("tool") and {"deepseek_r1", "qwen3"} <= set(registered_names("reasoning"))
    assert load_parser("tool", "hermes") is HermesToolParser
    assert load_parser("reasoning", "qwen3") is ThinkTagReasoningParser
    with pytest.raises(KeyError, match="registered: deepseek_v3, hermes, llama3_json, mistral, pythonic, qwen3_coder"):
        load_parser("tool", "nope")


def test_hermes_extracts_calls_and_keeps_other_text():
    content, calls = HermesToolParser.extract(f"Let me check. {CALL}")
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert HermesToolParser.extract("no calls here") == ("no calls here", [])
    content, calls = HermesToolParser.extract("<tool_call>not json</tool_call>")
    assert calls == [] and content == "<tool_call>not json</tool_call>"
    content, calls = HermesToolParser.extract('<tool_call>{"name": "f"')  # cut by max_tokens
    assert calls == [] and content.startswith("<tool_call>")


def _stream(parser, text: str, cut: int):
    return [parser.feed(text[:cut]), parser.feed(text[cut:])]


@pytest.mark.parametrize("cut", range(0, len("Hi " + CALL + " bye") + 1))
def test_hermes_streaming_gives_the_same_result_at_every_split(cut):
    text = "Hi " + CALL + " bye"
    p = HermesToolParser()
    parts = _stream(p, text, cut)
    content = "".join(c for c, _ in parts) + p.flush()[0]
    deltas = [d for _, ds in parts for d in ds]
    assert content == "Hi  bye" and [d.name for d in deltas if d.name] == ["get_weather"]
    assert {d.index for d in deltas} == {0}
    assert json.loads("".join(d.arguments for d in deltas)) == {"city": "Paris"}


def test_hermes_streams_arguments_as_they_are_written():
    p = HermesToolParser()
    text = "<tool_call>" + CALL.removeprefix("<tool_call>").removesuffix("</tool_call>") * 1 + "</tool_call>" + CALL
    deltas = [d for i in range(len(text)) for d in p.feed(text[i])[1]]
    assert [d.index for d in deltas if d.name] == [0, 1]
    assert sum(1 for d in deltas if d.arguments) > 5  # pieces, not one delta at the end
    first = "".join(d.arguments for d in deltas if d.index == 0)
    assert json.loads(first) == {"city": "Paris"}
    p = HermesToolParser()
    content, deltas = p.feed("<tool_call>not json</tool_call>")
    assert deltas == [] and content == "<tool_call>not json</tool_call>"


@pytest.mark.parametrize("cut", range(0, len("<think>hmm</think>\n\nParis") + 1))
def test_reasoning_streaming_gives_the_same_split_at_every_cut(cut):
    text = "<think>hmm</think>\n\nParis"
    p = ThinkTagReasoningParser()
    parts = _stream(p, text, cut) + [p.flush()]
    assert "".join(r for r, _ in parts) == "hmm" and "".join(c for _, c in parts) == "\n\nParis"
    assert ThinkTagReasoningParser.extract(text) == ("hmm", "Paris")
    assert ThinkTagReasoningParser.extract("Paris") == (None, "Paris")
    assert ThinkTagReasoningParser.extract("<think>still thinking") == ("still thinking", None)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_chat_route_returns_tool_calls_and_reasoning_when_configured(tokenizer, anyio_backend):
    import openai

    cfg = VllmConfig.model_validate(
        {"frontend": {"tool_call_parser": "hermes", "enable_auto_tool_choice": True, "reasoning_parser": "qwen3"}}
    )
    script = answer_script(tokenizer, "<think>User wants weather.</think>\n\n" + CALL)
    async with served(tokenizer, config=cfg, script=script) as (http, state, _fake):
        seen_tools = []
        render = state.llm.input_processor.render_chat

        def recording_render(messages, **kw):
            seen_tools.append(kw.get("tools"))
            return render(messages, **kw)

        state.llm.input_processor.render_chat = recording_render
        c = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        r = await c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, tools=TOOLS)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls[0].function.name == "get_weather"
        assert choice.message.model_extra["reasoning_content"] == "User wants weather."
        assert seen_tools[0][0]["function"]["name"] == "get_weather"  # the tools reach the chat template
        calls, reasoning, finish = [], "", None
        async for chunk in await c.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, tools=TOOLS, stream=True
        ):
            d = chunk.choices[0].delta
            calls += d.tool_calls or []
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            finish = chunk.choices[0].finish_reason or finish
        assert [tc.function.name for tc in calls if tc.function.name] == [
            "get_weather"
        ] and reasoning == "User wants weather."
        assert calls[0].id and all(tc.index == 0 for tc in calls) and len(calls) > 2  # arguments in pieces
        assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Paris"}
        assert finish == "tool_calls"
        r = await c.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, tools=TOOLS, tool_choice="none"
        )
        assert CALL.split("\n")[1] in r.choices[0].message.content and not r.choices[0].message.tool_calls

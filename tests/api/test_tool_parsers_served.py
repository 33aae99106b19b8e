"""Each tool-call parser behind the chat route, driven by the openai SDK (its streaming
helper assembles the calls from the deltas) over the app with a scripted engine: the model's
recorded output arrives token by token through the real detokenizer."""

from __future__ import annotations

import json

import pytest

from pkgd.config.vllm_config import VllmConfig

from .conftest import answer_script, served

MODEL = "SmolLM2-135M-Instruct"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
    for name in ("get_weather", "get_forecast")
]
MESSAGES = [{"role": "user", "content": "Weather in Paris and the forecast for Lyon?"}]
CALLS = [("get_weather", {"city": "Paris"}), ("get_forecast", {"city": "Lyon", "days": 3})]
BEFORE, AFTER = "Let me check both.", "Back soon."

# What each family writes for CALLS, with text before (and where the format allows, after).
OUTPUTS = {
    "hermes": f'{BEFORE}\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_forecast", "arguments": {"city": "Lyon", "days": 3}}\n</tool_call>',
    "llama3_json": f'{BEFORE} {{"name": "get_weather", "parameters": {{"city": "Paris"}}}}; '
    f'{{"name": "get_forecast", "parameters": {{"city": "Lyon", "days": 3}}}} {AFTER}',
    "mistral": f'{BEFORE}[TOOL_CALLS]get_weather[ARGS]{{"city": "Paris"}}[TOOL_CALLS]get_forecast[ARGS]'
    '{"city": "Lyon", "days": 3}',
    "pythonic": f'{BEFORE} [get_weather(city="Paris"), get_forecast(city="Lyon", days=3)] {AFTER}',
    "qwen3_coder": f"{BEFORE}\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=get_forecast>\n<parameter=city>\nLyon\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "deepseek_v3": f"{BEFORE}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_forecast\n'
    '```json\n{"city": "Lyon", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>' + AFTER,
}


def _config(parser: str) -> VllmConfig:
    return VllmConfig.model_validate({"frontend": {"tool_call_parser": parser, "enable_auto_tool_choice": True}})


def _content(parser: str) -> str:
    after = AFTER if AFTER in OUTPUTS[parser] else ""
    return f"{BEFORE}{' ' if parser in ('llama3_json', 'pythonic') else ''}{after}" if after else BEFORE


@pytest.mark.anyio
@pytest.mark.parametrize("parser", sorted(OUTPUTS))
async def test_calls_and_content_through_the_sdk_stream_helper(tokenizer, parser):
    import openai

    async with served(tokenizer, config=_config(parser), script=answer_script(tokenizer, OUTPUTS[parser])) as (
        http,
        _state,
        fake,
    ):
        c = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
        r = await c.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == CALLS
        assert msg.content.split() == _content(parser).split()
        assert fake.added[-1].sampling_params.skip_special_tokens is (parser != "mistral")

        deltas, content = [], ""
        async with c.chat.completions.stream(model=MODEL, messages=MESSAGES, tools=TOOLS) as stream:
            async for event in stream:
                if event.type == "tool_calls.function.arguments.delta":
                    deltas.append((event.index, event.arguments_delta))
                elif event.type == "content.delta":
                    content += event.delta
            final = await stream.get_final_completion()
        choice = final.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls] == CALLS
        assert len({t.id for t in choice.message.tool_calls}) == 2
        assert content.split() == _content(parser).split() and choice.message.content == content
        assert {i for i, _ in deltas} == {0, 1} and len(deltas) > 2  # per call, in pieces


@pytest.mark.anyio
@pytest.mark.parametrize("parser", ["llama3_json", "mistral", "pythonic", "qwen3_coder", "deepseek_v3"])
async def test_parallel_off_required_and_named_with_each_parser(tokenizer, parser):
    import openai

    async with served(tokenizer, config=_config(parser), script=answer_script(tokenizer, OUTPUTS[parser])) as (
        http,
        _state,
        fake,
    ):
        c = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
        r = await c.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, parallel_tool_calls=False)
        assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]
        fake.script = answer_script(tokenizer, '[{"name": "get_forecast", "parameters": {"city": "Lyon", "days": 3}}]')
        r = await c.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required")
        assert r.choices[0].finish_reason == "tool_calls"
        assert [(t.function.name, json.loads(t.function.arguments)) for t in r.choices[0].message.tool_calls] == CALLS[
            1:
        ]
        fake.script = answer_script(tokenizer, '{"city": "Paris"}')
        named = {"type": "function", "function": {"name": "get_weather"}}
        async with c.chat.completions.stream(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=named) as s:
            final = await s.get_final_completion()
        calls = final.choices[0].message.tool_calls
        assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == CALLS[:1]
        assert final.choices[0].finish_reason == "stop"  # as OpenAI answers a named choice
        assert fake.added[-1].sampling_params.skip_special_tokens  # only auto leaves calls to the parser

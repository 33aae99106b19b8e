"""The request surface around structured outputs, through the ``openai`` client with the
scripted engine: constraints reach the engine as `StructuredOutputsParams`, forced tool
calls come back parsed (and streamed as argument deltas), usage on every chunk, prompt
scoring with ``echo`` and ``max_tokens: 0``."""

from __future__ import annotations

import json

import openai
import pytest

from .conftest import answer_script, served

pytestmark = pytest.mark.anyio
MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def client(http) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)


async def test_every_constraint_form_reaches_the_engine(tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    async with served(tokenizer) as (http, _s, fake):
        c = client(http)
        await c.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"})
        await c.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": False}},
        )
        await c.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "text"})
        await c.completions.create(model=MODEL, prompt="x", extra_body={"structured_outputs": {"choice": ["a", "b"]}})
        await c.completions.create(model=MODEL, prompt="x", extra_body={"guided_regex": "[0-9]+"})
        await c.completions.create(model=MODEL, prompt="x", extra_body={"guided_json": schema})
        await c.completions.create(model=MODEL, prompt="x", extra_body={"guided_grammar": 'root ::= "a"'})
        so = [r.sampling_params.structured_outputs for r in fake.added]
        assert so[0].json_object and so[1].json == schema and not so[1].json_strict and so[2] is None
        assert so[3].choice == ["a", "b"] and so[4].regex == "[0-9]+" and so[5].json == schema and so[5].json_strict
        assert so[6].grammar == 'root ::= "a"'


async def test_a_tool_without_parameters_is_called_with_an_empty_object(tokenizer):
    tools = [{"type": "function", "function": {"name": "ping"}}]
    async with served(tokenizer, script=answer_script(tokenizer, '[{"name": "ping", "parameters": {}}]')) as (
        http,
        _s,
        fake,
    ):
        r = await client(http).chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=tools, tool_choice="required"
        )
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {}
        schema = fake.added[-1].sampling_params.structured_outputs.json
        assert schema["items"]["anyOf"][0]["properties"]["parameters"] == {
            "type": "object",
            "properties": {},
            "additionalProperties": False,
        }


async def test_named_and_required_tool_choice_return_parsed_calls(tokenizer):
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with served(tokenizer, script=answer_script(tokenizer, '{"city": "Paris"}')) as (http, _s, fake):
        c = client(http)
        r = await c.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=named)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content is None
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        assert fake.added[-1].sampling_params.structured_outputs.json == TOOLS[0]["function"]["parameters"]
        deltas = [
            d for ch in await _chunks(c, tools=TOOLS, tool_choice=named) for d in ch.choices[0].delta.tool_calls or []
        ]
        assert deltas[0].id and deltas[0].function.name == "get_weather" and len(deltas) > 2
        assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}
    two = (
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_weather", "parameters": '
        '{"city": "Rome"}}]'
    )
    async with served(tokenizer, script=answer_script(tokenizer, two)) as (http, _s, fake):
        c = client(http)
        r = await c.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required")
        assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 2
        schema = fake.added[-1].sampling_params.structured_outputs.json
        assert schema["minItems"] == 1 and "maxItems" not in schema
        r = await c.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
        )
        assert (
            len(r.choices[0].message.tool_calls) == 1
            and fake.added[-1].sampling_params.structured_outputs.json["maxItems"] == 1
        )
        chunks = await _chunks(c, tools=TOOLS, tool_choice="required")
        deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or []]
        assert [d.function.name for d in deltas if d.id] == ["get_weather", "get_weather"]
        args = {i: "".join(d.function.arguments or "" for d in deltas if d.index == i) for i in (0, 1)}
        assert [json.loads(a) for a in args.values()] == [{"city": "Paris"}, {"city": "Rome"}]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def _chunks(c, **kw):
    return [
        ch
        async for ch in await c.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kw)
        if ch.choices
    ]


async def test_continuous_usage_stats_puts_usage_on_every_chunk(tokenizer):
    async with served(tokenizer) as (http, _s, _f):
        c = client(http)
        opts = {"include_usage": True, "continuous_usage_stats": True}
        chunks = [
            ch
            async for ch in await c.chat.completions.create(
                model=MODEL, messages=MESSAGES, stream=True, stream_options=opts
            )
        ]
        counts = [ch.usage.completion_tokens for ch in chunks if ch.choices and ch.choices[0].delta.content]
        assert counts and counts == sorted(counts) and counts[-1] > counts[0]
        chunks = [
            ch
            async for ch in await c.completions.create(
                model=MODEL, prompt="x", stream=True, stream_options=opts, max_tokens=4
            )
        ]
        assert all(ch.usage is not None for ch in chunks)


async def test_echo_with_max_tokens_zero_scores_the_prompt(tokenizer):
    async with served(tokenizer) as (http, _s, fake):
        r = await client(http).completions.create(
            model=MODEL, prompt="The capital of France", max_tokens=0, echo=True, logprobs=1
        )
        choice, n = r.choices[0], r.usage.prompt_tokens
        assert (
            choice.text == "The capital of France"
            and r.usage.completion_tokens == 0
            and choice.finish_reason == "length"
        )
        assert len(choice.logprobs.tokens) == n and choice.logprobs.token_logprobs[0] is None
        assert fake.added[-1].sampling_params.prompt_logprobs == 1 and fake.added[-1].sampling_params.max_tokens == 1
